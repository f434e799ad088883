"""Shared cases for the ladder tests: every forward algorithm behind one signature; IO counting."""
from flashlib.ladder import decoding, fa1, fa2, memeff, naive
from flashlib.ladder.iomodel import IOCounter

B = 2  # bytes per element used throughout (fp16 model)


def counted(fn, *args, bytes_per_element=B, **kwargs):
    io = IOCounter(bytes_per_element=bytes_per_element)
    fn(*args, io=io, **kwargs)
    return io.hbm_read_bytes, io.hbm_write_bytes


# name -> f(q, k, v, causal, scale, blocks) returning (o, lse or None); blocks = (bq, bk, splits)
FORWARDS = {
    "naive": lambda q, k, v, c, s, b: (naive.attention(q, k, v, causal=c, scale=s), None),
    "fa1": lambda q, k, v, c, s, b: (fa1.forward(q, k, v, causal=c, scale=s, block_q=b[0],
                                                 block_k=b[1]), None),
    "fa2": lambda q, k, v, c, s, b: fa2.forward(q, k, v, causal=c, scale=s, block_q=b[0],
                                                block_k=b[1]),
    "decoding": lambda q, k, v, c, s, b: decoding.forward(q, k, v, causal=c, scale=s,
                                                          num_splits=b[2]),
    "lse_first": lambda q, k, v, c, s, b: memeff.lse_first(q, k, v, causal=c, scale=s,
                                                           block_k=b[1]),
    "chunked": lambda q, k, v, c, s, b: memeff.chunked(q, k, v, causal=c, scale=s,
                                                       query_chunk=b[0], key_chunk=b[1]),
}

# (block_q, block_k, num_splits) that divide none of the adversarial lengths
ODD_BLOCKS = (7, 5, 3)
