"""``python -m flashlib.figures``: redraw the book's static figures: the landing page's roadmap
(book/_static/roadmap.svg) and the GPU primer's memory hierarchy (book/_static/memory_hierarchy.svg)."""
from . import write_memory_hierarchy, write_roadmap

print(f"wrote {write_roadmap()}")
print(f"wrote {write_memory_hierarchy()}")
