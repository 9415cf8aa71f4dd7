// Collectives between the ranks of one machine through a shared-memory workspace (ops pmx_cpu::shm_*).
//
// The CPU communicator (runner/parallel/comm.py, MpiComm) maps one workspace into every rank: a header of one
// 64-byte line per rank holding that rank's sequence counter, then two sets ("parities") of one slot per rank.
// A collective, for each chunk of at most one slot:
//   seq = ++counter[me]; copy my chunk into slot[seq & 1][me]; publish counter[me] = seq (release);
//   wait until counter[r] >= seq for every rank r (acquire); read every rank's slot[seq & 1][r].
// A rank writes parity p again only at seq + 2, and it gets there only after every rank published seq + 1,
// that is after every rank finished reading seq: two parities make the one wait per chunk enough.
// all_reduce sums the slots in rank order 0..N-1 on every rank, so all ranks hold the same bits (for two ranks,
// the same bits as MPI's a + b). Half types are summed in float32 and rounded once.
//
// reduce_norm (sequence parallelism between two row-parallel linears, runner.engine.model.SeqParallel) works on a
// region of its own after the slots: one partial area per rank, then one shared "normed" area, `area` bytes each.
// Every rank puts its partial output [M, D] of a row-parallel linear in its partial area and waits for all; then, for
// its own rows only (rows_of_rank: a contiguous 1/N of them), sums the partials in rank order 0..N-1, adds the
// residual of those rows (which only this rank keeps), applies RMSNorm, writes the rows' normed output into the
// normed area and waits for all again; every rank then reads all M normed rows in place as its next linear's input.
// Against all_reduce_ + skip_rms_norm on every row, a rank moves about a third of the bytes and norms 1/N of the rows,
// and the results are the same bits. The rank's next writes to the areas come after this call's second wait, which
// every rank passes only once it has read the other ranks' partials: its GEMM into its partial area (the caller may
// write the partial there itself, saving the copy), then its rows of the normed area in the next call, after that
// call's first wait, which every rank reaches only once its linear has read this call's normed rows.
//
// Waiting spins (pause), then yields the core (sched_yield: ranks may outnumber cores), and, while it waits,
// lets other Python threads run (the GIL is released, so the communicator's watchdog can end a job whose peer
// hangs). A wait past `timeout_s` raises an error naming the collective and the rank waited for. A longer wait also
// looks, every PEER_LOOK_S, whether the rank it waits for still runs (its pid, which each rank writes in its header
// line at 8 bytes, 0 where the ranks cannot see each other's processes: runner/parallel/shm.py): a peer that has
// exited (or is a zombie) raises at once, whatever the launcher does about it (MPICH's launcher kills the other
// ranks when one exits, but can miss it: the others would wait for the collective timeout).
// Measured on the project's 2-core box, 768 floats between 2 ranks, called from Python: 2.8 us, against 4-5 us
// for mpi4py's Allreduce, and ~30 us for that as a Python torch op inside the compiled step (benchmarks/RESULTS.md,
// "Tensor parallelism on CPU").

#include <Python.h>

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <fcntl.h>
#include <immintrin.h>
#include <sched.h>
#include <unistd.h>

#include "cpu_kernels.h"

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <utility>

namespace {

constexpr int64_t LINE = 64;     // bytes per rank in the header (one cache line each: no false sharing)
constexpr int64_t HEADER = 4096;  // header bytes before the slots (room for 64 ranks)
constexpr int64_t PID_AT = 8;     // where a rank's pid sits in its header line (after its counter)
#define PEER_ENDED "ended while rank"  // runner/parallel/job.py's PEER_ENDED: the error's one line, no traceback
constexpr double PEER_LOOK_S = 0.05;  // how often a long wait looks whether the rank it waits for still runs

struct Workspace {
  uint8_t* base;
  int64_t rank, world, slot;  // slot: bytes per rank per parity

  Workspace(const at::Tensor& ws, int64_t rank_, int64_t world_) : rank(rank_), world(world_) {
    TORCH_CHECK(ws.scalar_type() == at::kByte && ws.dim() == 1 && ws.is_contiguous(),
                "shared-memory workspace must be a contiguous uint8 tensor");
    TORCH_CHECK(world >= 1 && world <= HEADER / LINE && rank >= 0 && rank < world,
                "shared-memory collective: rank ", rank, " of ", world, " is out of range");
    base = ws.data_ptr<uint8_t>();
    slot = (ws.numel() - HEADER) / (2 * world) / LINE * LINE;
    TORCH_CHECK(slot >= LINE, "shared-memory workspace of ", ws.numel(), " bytes is too small for ", world, " ranks");
  }
  int64_t* counter(int64_t r) const { return reinterpret_cast<int64_t*>(base + r * LINE); }
  int64_t pid(int64_t r) const { return __atomic_load_n(reinterpret_cast<int64_t*>(base + r * LINE + PID_AT), __ATOMIC_RELAXED); }
  uint8_t* data(int64_t parity, int64_t r) const { return base + HEADER + (parity * world + r) * slot; }
};

// Whether process `pid` has exited: /proc has no such process, or it is a zombie (exited, not yet reaped).
bool process_ended(int64_t pid) {
  if (pid <= 0) return false;
  char path[64], buf[512];
  std::snprintf(path, sizeof(path), "/proc/%lld/stat", static_cast<long long>(pid));
  const int fd = ::open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return errno == ENOENT || errno == ESRCH;
  const ssize_t n = ::read(fd, buf, sizeof(buf) - 1);
  ::close(fd);
  if (n <= 0) return n == 0;  // read on an exiting process's stat
  buf[n] = 0;
  const char* end = std::strrchr(buf, ')');  // "pid (comm) S ...": the comm may hold spaces and parentheses
  return end != nullptr && end[1] == ' ' && (end[2] == 'Z' || end[2] == 'X');
}

// Publishes `seq` for this rank and waits until every rank has published it.
void arrive_and_wait(const Workspace& w, int64_t seq, double timeout_s, const char* what) {
  __atomic_store_n(w.counter(w.rank), seq, __ATOMIC_RELEASE);
  for (int64_t r = 0; r < w.world; ++r) {
    if (__atomic_load_n(w.counter(r), __ATOMIC_ACQUIRE) >= seq) continue;
    for (int spin = 0; spin < 4000; ++spin) {  // a peer a few microseconds behind: spin
      _mm_pause();
      if (__atomic_load_n(w.counter(r), __ATOMIC_ACQUIRE) >= seq) break;
    }
    if (__atomic_load_n(w.counter(r), __ATOMIC_ACQUIRE) >= seq) continue;
    pmx_cpu::GilRelease unlocked;  // a longer wait: let other threads run, give the core away between looks
    const auto t0 = std::chrono::steady_clock::now();
    double next_look = PEER_LOOK_S;
    for (int64_t i = 1; __atomic_load_n(w.counter(r), __ATOMIC_ACQUIRE) < seq; ++i) {
      sched_yield();
      if (i % 256 != 0) continue;
      const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      if (waited > next_look) {
        next_look = waited + PEER_LOOK_S;
        const int64_t pid = w.pid(r);
        TORCH_CHECK(__atomic_load_n(w.counter(r), __ATOMIC_ACQUIRE) >= seq || !process_ended(pid),
                    "rank ", r, " (pid ", pid, ") " PEER_ENDED " ", w.rank, " waited for it in ", what);
      }
      TORCH_CHECK(waited <= timeout_s, what, " did not complete within ", timeout_s, "s: rank ", w.rank,
                  " waited for rank ", r, ", which has probably died or hung");
    }
  }
}

template <typename T>
void sum_slots(const Workspace& w, int64_t parity, int64_t n, T* out) {
  if constexpr (std::is_same_v<T, float>) {
    const float* s0 = reinterpret_cast<const float*>(w.data(parity, 0));
    if (w.world == 1) {
      std::memcpy(out, s0, n * sizeof(float));
      return;
    }
    const float* s1 = reinterpret_cast<const float*>(w.data(parity, 1));
    for (int64_t i = 0; i < n; ++i) out[i] = s0[i] + s1[i];
    for (int64_t r = 2; r < w.world; ++r) {
      const float* s = reinterpret_cast<const float*>(w.data(parity, r));
      for (int64_t i = 0; i < n; ++i) out[i] += s[i];
    }
  } else {
    for (int64_t i = 0; i < n; ++i) {
      float acc = static_cast<float>(reinterpret_cast<const T*>(w.data(parity, 0))[i]);
      for (int64_t r = 1; r < w.world; ++r) acc += static_cast<float>(reinterpret_cast<const T*>(w.data(parity, r))[i]);
      out[i] = static_cast<T>(acc);
    }
  }
}

template <typename T>
void all_reduce_typed(const Workspace& w, T* t, int64_t numel, double timeout_s) {
  const int64_t per_chunk = w.slot / static_cast<int64_t>(sizeof(T));
  for (int64_t off = 0; off < numel; off += per_chunk) {
    const int64_t n = std::min(per_chunk, numel - off);
    const int64_t seq = __atomic_load_n(w.counter(w.rank), __ATOMIC_RELAXED) + 1;
    std::memcpy(w.data(seq & 1, w.rank), t + off, n * sizeof(T));
    arrive_and_wait(w, seq, timeout_s, "all_reduce");
    sum_slots<T>(w, seq & 1, n, t + off);
  }
}

void shm_all_reduce_(at::Tensor t, const at::Tensor& ws, int64_t rank, int64_t world, double timeout_s) {
  TORCH_CHECK(t.device().is_cpu() && t.is_contiguous(), "shm_all_reduce_: t must be a contiguous CPU tensor");
  const Workspace w(ws, rank, world);
  switch (t.scalar_type()) {
    case at::kFloat: all_reduce_typed(w, t.data_ptr<float>(), t.numel(), timeout_s); break;
    case at::kBFloat16: all_reduce_typed(w, t.data_ptr<c10::BFloat16>(), t.numel(), timeout_s); break;
    case at::kHalf: all_reduce_typed(w, t.data_ptr<c10::Half>(), t.numel(), timeout_s); break;
    default: TORCH_CHECK(false, "shm_all_reduce_: float32, bfloat16 or float16 expected, got ", t.scalar_type());
  }
}

void all_gather_bytes(const Workspace& w, const uint8_t* src, int64_t bytes, uint8_t* dst, double timeout_s) {
  for (int64_t off = 0; off < bytes; off += w.slot) {
    const int64_t n = std::min(w.slot, bytes - off);
    const int64_t seq = __atomic_load_n(w.counter(w.rank), __ATOMIC_RELAXED) + 1;
    std::memcpy(w.data(seq & 1, w.rank), src + off, n);
    arrive_and_wait(w, seq, timeout_s, "all_gather");
    for (int64_t r = 0; r < w.world; ++r) std::memcpy(dst + r * bytes + off, w.data(seq & 1, r), n);
  }
}

// [numel] of each rank -> [world * numel], rank-major (any dtype: bytes are moved, not added).
at::Tensor shm_all_gather(const at::Tensor& t, const at::Tensor& ws, int64_t rank, int64_t world, double timeout_s) {
  TORCH_CHECK(t.device().is_cpu() && t.is_contiguous(), "shm_all_gather: t must be a contiguous CPU tensor");
  const Workspace w(ws, rank, world);
  at::Tensor out = at::empty({world * t.numel()}, t.options());
  all_gather_bytes(w, static_cast<const uint8_t*>(t.data_ptr()), t.numel() * t.element_size(),
                   static_cast<uint8_t*>(out.data_ptr()), timeout_s);
  return out;
}

// Rows [first, last) of the M rows that rank `rank` of `world` reduces and norms (SeqParallel.rows in Python).
std::pair<int64_t, int64_t> rows_of_rank(int64_t M, int64_t rank, int64_t world) {
  const int64_t per = (M + world - 1) / world, first = std::min(M, rank * per);
  return {first, std::min(M, first + per)};
}

void shm_reduce_norm_(const at::Tensor& partial, at::Tensor residual, const at::Tensor& weight, double eps,
                      const at::Tensor& ws, at::Tensor region, int64_t area, int64_t rank, int64_t world,
                      double timeout_s) {
  TORCH_CHECK(partial.dim() == 2 && partial.scalar_type() == at::kFloat && partial.is_contiguous(),
              "shm_reduce_norm_: partial must be contiguous float32 [M, D]");
  const int64_t M = partial.size(0), D = partial.size(1);
  const auto [r0, r1] = rows_of_rank(M, rank, world);
  TORCH_CHECK(residual.scalar_type() == at::kFloat && residual.is_contiguous() && residual.dim() == 2 &&
                  residual.size(0) == r1 - r0 && residual.size(1) == D,
              "shm_reduce_norm_: residual must be contiguous float32 [", r1 - r0, ", ", D, "] (rank ", rank,
              "'s rows of ", M, ")");
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.is_contiguous() && weight.numel() == D,
              "shm_reduce_norm_: weight must be contiguous float32 [", D, "]");
  TORCH_CHECK(region.scalar_type() == at::kByte && region.is_contiguous() && area % LINE == 0 &&
                  region.numel() >= (world + 1) * area && M * D * 4 <= area,
              "shm_reduce_norm_: ", M, " x ", D, " floats do not fit the region's areas of ", area, " bytes");
  const Workspace w(ws, rank, world);
  uint8_t* reg = region.data_ptr<uint8_t>();
  const auto part = [&](int64_t r) { return reinterpret_cast<float*>(reg + r * area); };
  float* normed = reinterpret_cast<float*>(reg + world * area);
  if (partial.data_ptr<float>() != part(rank)) std::memcpy(part(rank), partial.data_ptr<float>(), M * D * 4);
  const int64_t seq = __atomic_load_n(w.counter(rank), __ATOMIC_RELAXED) + 1;
  arrive_and_wait(w, seq, timeout_s, "reduce_norm");
  float* mine = part(rank) + r0 * D;  // my rows of my partial area: nobody else reads them
  if (world > 1) {  // (p0 + p1) + p2 ...: all_reduce_'s order, in runs of CHUNK (my area is one of the inputs)
    constexpr int64_t CHUNK = 1024;
    at::parallel_for(r0 * D, r1 * D, 16384, [&](int64_t i0, int64_t i1) {
      float acc[CHUNK];
      for (int64_t c0 = i0; c0 < i1; c0 += CHUNK) {
        const int64_t n = std::min(CHUNK, i1 - c0);
        const float *p0 = part(0) + c0, *p1 = part(1) + c0;
        for (int64_t i = 0; i < n; ++i) acc[i] = p0[i] + p1[i];
        for (int64_t r = 2; r < world; ++r) {
          const float* pr = part(r) + c0;
          for (int64_t i = 0; i < n; ++i) acc[i] += pr[i];
        }
        std::memcpy(part(rank) + c0, acc, n * sizeof(float));
      }
    });
  }
  float* res = residual.data_ptr<float>();
  pmx_cpu::skip_rms_norm_into(mine, res, weight.data_ptr<float>(), r1 - r0, D, static_cast<float>(eps), res,
                              normed + r0 * D);
  arrive_and_wait(w, seq + 1, timeout_s, "reduce_norm");
}

int64_t shm_header_bytes() { return HEADER; }

}  // namespace

namespace pmx_cpu {

GilRelease::GilRelease() {
  if (Py_IsInitialized() && PyGILState_Check()) state = PyEval_SaveThread();
}

GilRelease::~GilRelease() {
  if (state != nullptr) PyEval_RestoreThread(static_cast<PyThreadState*>(state));
}

void shm_all_reduce_f32(const at::Tensor& ws, int64_t rank, int64_t world, float* t, int64_t numel, double timeout_s) {
  all_reduce_typed(Workspace(ws, rank, world), t, numel, timeout_s);
}

void shm_all_gather_bytes(const at::Tensor& ws, int64_t rank, int64_t world, const void* src, int64_t bytes, void* out,
                          double timeout_s) {
  all_gather_bytes(Workspace(ws, rank, world), static_cast<const uint8_t*>(src), bytes, static_cast<uint8_t*>(out),
                   timeout_s);
}

}  // namespace pmx_cpu

TORCH_LIBRARY_FRAGMENT(pmx_cpu, m) {
  m.def("shm_all_reduce_(Tensor(a!) t, Tensor ws, int rank, int world, float timeout_s) -> ()");
  m.def("shm_all_gather(Tensor t, Tensor ws, int rank, int world, float timeout_s) -> Tensor");
  m.def("shm_header_bytes() -> int", &shm_header_bytes);
  m.def("shm_reduce_norm_(Tensor(c!) partial, Tensor(a!) residual, Tensor weight, float eps, Tensor ws, Tensor(b!) region, "
        "int area, int rank, int world, float timeout_s) -> ()");
}

TORCH_LIBRARY_IMPL(pmx_cpu, CPU, m) {
  m.impl("shm_all_reduce_", &shm_all_reduce_);
  m.impl("shm_all_gather", &shm_all_gather);
  m.impl("shm_reduce_norm_", &shm_reduce_norm_);
}
