// runner.cpp — main() of the emulator's child process (included once, after the kernels, by the
// harness that flashlib/kernels/cuda/build.py generates).
//
// It reads a plan on stdin, one command per line, and carries it out in order:
//   buffer <id> <nbytes> file <path> | nan | zero    allocate a "device" buffer (256-byte aligned,
//                                                    exactly nbytes so ASan sees overruns) and fill it
//   launch <kernel> gx gy gz bx by bz smem <n> tok…  launch; tok = b<id> (buffer), i<int32>, l<int64>,
//                                                    f<float bits as uint32>
//   out <id> <path>                                  write a buffer back to a file
// The argument kinds are checked against the kernel's parameter list before the launch.
// Explained in: notebooks/08_cuda.
#include <fstream>
#include <iostream>
#include <sstream>

int main() {
    std::map<long, std::pair<unsigned char*, size_t>> bufs;
    std::string line;
    while (std::getline(std::cin, line)) {
        std::istringstream in(line);
        std::string cmd;
        if (!(in >> cmd)) continue;
        if (cmd == "buffer") {
            long id; size_t n; std::string how;
            in >> id >> n >> how;
            void* p = nullptr;
            if (posix_memalign(&p, 256, n ? n : 1) != 0) emu::fail("out of memory for buffer %ld", id);
            auto* b = static_cast<unsigned char*>(p);
            if (how == "file") {
                std::string path; in >> path;
                std::ifstream f(path, std::ios::binary);
                if (!f.read(reinterpret_cast<char*>(b), std::streamsize(n)))
                    emu::fail("could not read %zu bytes from %s", n, path.c_str());
            } else if (how == "nan") {
                std::memset(b, 0xFF, n);
            } else {
                std::memset(b, 0, n);
            }
            bufs[id] = {b, n};
        } else if (cmd == "launch") {
            std::string name; unsigned gx, gy, gz, bx, by, bz; size_t smem; int nargs;
            in >> name >> gx >> gy >> gz >> bx >> by >> bz >> smem >> nargs;
            auto it = emu::registry().find(name);
            if (it == emu::registry().end()) emu::fail("no kernel called %s in this source", name.c_str());
            const std::string& sig = it->second.signature;
            if (int(sig.size()) != nargs)
                emu::fail("%s takes %zu arguments, the launch passed %d", name.c_str(), sig.size(), nargs);
            std::vector<uint64_t> slots(nargs);
            std::vector<void*> args(nargs);
            for (int i = 0; i < nargs; ++i) {
                std::string tok; in >> tok;
                const char kind = tok.empty() ? '?' : tok[0];
                const char want = sig[i] == 'p' ? 'b' : sig[i];
                if (kind != want)
                    emu::fail("argument %d of %s: the kernel takes kind '%c', the launch passed '%s'", i,
                              name.c_str(), sig[i], tok.c_str());
                const std::string v = tok.substr(1);
                if (kind == 'b') {
                    auto b = bufs.find(std::stol(v));
                    if (b == bufs.end()) emu::fail("argument %d of %s: unknown buffer %s", i, name.c_str(), v.c_str());
                    void* p = b->second.first;
                    std::memcpy(&slots[i], &p, sizeof p);
                } else if (kind == 'i') {
                    int32_t x = int32_t(std::stol(v)); std::memcpy(&slots[i], &x, 4);
                } else if (kind == 'l') {
                    int64_t x = std::stoll(v); std::memcpy(&slots[i], &x, 8);
                } else if (kind == 'f') {
                    uint32_t x = uint32_t(std::stoul(v)); std::memcpy(&slots[i], &x, 4);
                }
                args[i] = &slots[i];
            }
            it->second.run(dim3(gx, gy, gz), dim3(bx, by, bz), smem, args.data());
        } else if (cmd == "out") {
            long id; std::string path;
            in >> id >> path;
            auto b = bufs.find(id);
            if (b == bufs.end()) emu::fail("out: unknown buffer %ld", id);
            std::ofstream f(path, std::ios::binary);
            f.write(reinterpret_cast<const char*>(b->second.first), std::streamsize(b->second.second));
            if (!f) emu::fail("could not write %s", path.c_str());
        } else {
            emu::fail("unknown plan command '%s'", cmd.c_str());
        }
    }
    for (auto& [id, b] : bufs) std::free(b.first);
    emu::write_counts();
    return 0;
}
