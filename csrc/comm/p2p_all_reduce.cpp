// The lossless fp32 all-reduce of a CPU group in one op, without the GIL (ordered, or exact mode's
// sum of each piece: flatcomm/comm/exact.py's transfers are the same pieces): the point-to-point
// transfers of flatcomm/comm/flat.py `_raw_all_reduce_p2p`, with the same tags in the same order
// and the same fixed-order sum, minus the Python between transfers (the worker thread holding the
// GIL while DDP's autograd thread waits for it) and minus the copy of this rank's own piece: the
// sum reads it where it lies.
//
// Per chunk j (pieces[d][j] .. pieces[d][j + 1] is chunk j of rank d's shard):
//   send(j):   chunk j of every peer's shard to that peer; the peers' chunk j of this rank's shard
//              into rows of `scratch`.
//   reduce(j): wait for send(j); sum chunk j of this rank's shard over the rows in ascending rank
//              order, in place; send it to every peer and receive theirs in place (the gather).
//   finish(j): wait for the gather of chunk j.
// run in flatcomm.comm.pipeline.Pipeline.run's order (send(j + 1) before reduce(j), finish(j - 1)
// after reduce(j)); every exchange takes the next tag after `tag_base`, so a peer on the Python
// path, staged or not, meets each transfer with the matching one. (The tag base is the call's
// agreed plan, flatcomm/comm/agreed.py: calls of different signatures never meet.)
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include "../core/common.h"
#include "../cpu/kernels.h"
#include "../ops_common.h"
#include "lane.h"
#include "p2p_all_reduce.h"

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

namespace flatcomm {
namespace ops {
namespace {

constexpr int64_t kTile = 1024;          // values summed per step (through a stack tile)
constexpr int64_t kGrainTiles = 32;      // small pieces stay on one thread
constexpr int64_t kExactGrain = 1 << 15; // values of an exact sum per thread at least (as the op's)

using Works = std::vector<c10::intrusive_ptr<c10d::Work>>;

}  // namespace

void ordered_sum(const std::vector<const float*>& rows, float scale, int64_t n, float* out) {
  at::parallel_for(0, (n + kTile - 1) / kTile, kGrainTiles, [&](int64_t t0, int64_t t1) {
    float acc[kTile];
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t i0 = t * kTile, m = std::min(kTile, n - i0);
      std::copy(rows[0] + i0, rows[0] + i0 + m, acc);
      for (size_t r = 1; r < rows.size(); ++r) {
        const float* x = rows[r] + i0;
        for (int64_t j = 0; j < m; ++j) acc[j] = core::add_in_order(acc[j], x[j]);
      }
      if (scale != 1.0f)
        for (int64_t j = 0; j < m; ++j) acc[j] = acc[j] * scale;
      std::copy(acc, acc + m, out + i0);
    }
  });
}

void exact_sum_into(const std::vector<const void*>& rows, int64_t n, double scale, int64_t block, int64_t headroom,
                    at::Tensor& into) {
  const int64_t world = static_cast<int64_t>(rows.size());
  check_exact_block(block);
  TORCH_CHECK(world <= (int64_t{1} << headroom), "flatcomm: exact_sum of ", world,
              " rows needs headroom >= log2(rows); got headroom ", headroom);
  if (into.scalar_type() == at::kFloat) {
    // fp32 (the lane's pieces): the kernel reads the rows where they lie and writes the sum into
    // `into` block by block, each block's rows read before its sum is written (so `into` may be a
    // row); then times scale as torch's mul does: the bits of exact_sum(stacked) * scale, copied.
    ExactArgs a{};
    a.dtype = core::kF32;
    a.rows = world;
    a.n = n;
    a.block = block;
    a.precision = precision_of(headroom);
    a.out = into.data_ptr<float>();
    const auto& kernels = cpu::kernels();
    at::parallel_for(0, core::ceil_div(n, block), std::max<int64_t>(1, kExactGrain / block),
                     [&](int64_t b0, int64_t b1) {
                       kernels.exact_sum_rows(a, rows.data(), b0 * block, std::min(n, b1 * block));
                     });
    if (scale != 1.0) into.mul_(scale);
    return;
  }
  // bf16 / fp16 (the header slot's): the op on the stacked rows, then ATen's mul and copy_, as
  // flatcomm/comm/small.py rounds the fp32 sum into the tensor.
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("flatcomm::exact_sum", "")
                       .typed<at::Tensor(const at::Tensor&, int64_t, int64_t)>();
  at::Tensor stacked = at::empty({world, n}, into.options());
  const int64_t nbytes = n * stacked.element_size();
  for (int64_t r = 0; r < world; ++r)
    std::memcpy(static_cast<char*>(stacked.data_ptr()) + r * nbytes, rows[r], nbytes);
  at::Tensor val = op.call(stacked, block, headroom);
  if (scale != 1.0) val = val.mul(scale);
  into.copy_(val);
}

namespace {

// Waits for every work, the first error rethrown after all have settled: a failed call leaves no
// transfer in flight into a buffer that is about to be reused.
void wait_all(Works& works) {
  std::exception_ptr first;
  for (auto& w : works) {
    try {
      w->wait();
    } catch (...) {
      if (!first) first = std::current_exception();
    }
  }
  works.clear();
  if (first) std::rethrow_exception(first);
}

class P2pAllReduce {
 public:
  P2pAllReduce(const at::Tensor& flat, const at::Tensor& scratch, c10::intrusive_ptr<c10d::Backend> pg,
               at::IntArrayRef pieces, int64_t chunks, double scale, int tag_base, int64_t exact_block,
               int64_t headroom)
      : flat_(flat), scratch_(scratch), pg_(std::move(pg)), pieces_(pieces), chunks_(chunks), scale_(scale),
        exact_block_(exact_block), headroom_(headroom), me_(pg_->getRank()), world_(pg_->getSize()),
        tag_(tag_base), sent_(chunks), gathered_(chunks) {}

  void run() {
    try {
      if (chunks_) send(0);
      for (int64_t j = 0; j < chunks_; ++j) {
        if (j + 1 < chunks_) send(j + 1);
        reduce(j);
        if (j >= 1) wait_all(gathered_[j - 1]);
      }
      if (chunks_) wait_all(gathered_[chunks_ - 1]);
    } catch (...) {
      for (auto* stage : {&sent_, &gathered_})
        for (auto& works : *stage) {
          try {
            wait_all(works);
          } catch (...) {  // the first error is the one raised
          }
        }
      throw;
    }
  }

 private:
  int64_t start(int64_t rank, int64_t j) const { return pieces_[rank * (chunks_ + 1) + j]; }
  int64_t len(int64_t rank, int64_t j) const { return start(rank, j + 1) - start(rank, j); }
  at::Tensor piece(int64_t rank, int64_t j) const { return flat_.narrow(0, start(rank, j), len(rank, j)); }

  // Chunk j's rows of the peers, (world - 1) rows after the earlier chunks' rows.
  at::Tensor row(int64_t peer, int64_t j) const {
    const int64_t before = start(me_, j) - start(me_, 0);
    const int64_t slot = peer < me_ ? peer : peer - 1;
    return scratch_.narrow(0, (world_ - 1) * before + slot * len(me_, j), len(me_, j));
  }

  void post(Works& works, int tag, const std::vector<std::pair<int64_t, at::Tensor>>& sends,
            const std::vector<std::pair<int64_t, at::Tensor>>& recvs) {
    for (auto& [peer, t] : recvs)  // receives first, as flatcomm/comm/p2p.py posts them
      if (t.numel()) {
        std::vector<at::Tensor> one{t};
        works.push_back(pg_->recv(one, static_cast<int>(peer), tag));
      }
    for (auto& [peer, t] : sends)
      if (t.numel()) {
        std::vector<at::Tensor> one{t};
        works.push_back(pg_->send(one, static_cast<int>(peer), tag));
      }
  }

  void send(int64_t j) {
    std::vector<std::pair<int64_t, at::Tensor>> sends, recvs;
    for (int64_t d = 0; d < world_; ++d)
      if (d != me_) {
        sends.emplace_back(d, piece(d, j));
        recvs.emplace_back(d, row(d, j));
      }
    post(sent_[j], ++tag_, sends, recvs);
  }

  void reduce(int64_t j) {
    wait_all(sent_[j]);
    at::Tensor mine = piece(me_, j);
    if (exact_block_ > 0) {
      std::vector<const void*> rows;
      for (int64_t d = 0; d < world_; ++d) rows.push_back(d == me_ ? mine.data_ptr() : row(d, j).data_ptr());
      exact_sum_into(rows, mine.numel(), scale_, exact_block_, headroom_, mine);
    } else {
      std::vector<const float*> rows;
      for (int64_t d = 0; d < world_; ++d)
        rows.push_back(d == me_ ? mine.data_ptr<float>() : row(d, j).data_ptr<float>());
      ordered_sum(rows, static_cast<float>(scale_), mine.numel(), mine.data_ptr<float>());
    }
    std::vector<std::pair<int64_t, at::Tensor>> sends, recvs;
    for (int64_t d = 0; d < world_; ++d)
      if (d != me_) {
        sends.emplace_back(d, mine);
        recvs.emplace_back(d, piece(d, j));
      }
    post(gathered_[j], ++tag_, sends, recvs);
  }

  at::Tensor flat_, scratch_;
  c10::intrusive_ptr<c10d::Backend> pg_;  // the group's CPU backend: no Python between transfers
  at::IntArrayRef pieces_;
  int64_t chunks_;
  double scale_;  // (ordered_sum takes it as fp32, exact_sum_into as torch's mul does)
  int64_t exact_block_, headroom_;
  int64_t me_, world_;
  int tag_;
  std::vector<Works> sent_, gathered_;
};

}  // namespace

void p2p_sum_all_reduce_(const at::Tensor& flat, const at::Tensor& scratch,
                         const c10::intrusive_ptr<c10d::Backend>& pg, at::IntArrayRef pieces, int64_t chunks,
                         double scale, int64_t tag_base, int64_t exact_block, int64_t headroom) {
  TORCH_CHECK(flat.device().is_cpu() && flat.scalar_type() == at::kFloat && flat.is_contiguous() && flat.dim() == 1,
              "flatcomm: p2p_sum_all_reduce_ takes a contiguous 1-d CPU fp32 tensor, got ", flat.toString(), " ",
              flat.sizes());
  TORCH_CHECK(chunks >= 0, "flatcomm: p2p_sum_all_reduce_: chunks must be >= 0, got ", chunks);
  const int64_t me = pg->getRank(), world = pg->getSize();
  TORCH_CHECK(static_cast<int64_t>(pieces.size()) == world * (chunks + 1),
              "flatcomm: p2p_sum_all_reduce_: pieces must hold world * (chunks + 1) = ", world * (chunks + 1),
              " bounds, got ", pieces.size());
  for (int64_t d = 0; d < world; ++d)
    for (int64_t j = 0; j < chunks; ++j) {
      const int64_t a = pieces[d * (chunks + 1) + j], b = pieces[d * (chunks + 1) + j + 1];
      TORCH_CHECK(0 <= a && a <= b && b <= flat.numel(), "flatcomm: p2p_sum_all_reduce_: piece ", j, " of rank ", d,
                  " is [", a, ", ", b, "), outside the tensor of ", flat.numel(), " values");
    }
  const int64_t shard = chunks ? pieces[me * (chunks + 1) + chunks] - pieces[me * (chunks + 1)] : 0;
  TORCH_CHECK(scratch.device().is_cpu() && scratch.scalar_type() == at::kFloat && scratch.is_contiguous() &&
                  scratch.numel() >= (world - 1) * shard,
              "flatcomm: p2p_sum_all_reduce_: scratch must be a contiguous CPU fp32 tensor of at least ",
              (world - 1) * shard, " values, got ", scratch.toString(), " ", scratch.sizes());
  TORCH_CHECK(0 <= tag_base && tag_base + 2 * chunks < (int64_t{1} << 31),
              "flatcomm: p2p_sum_all_reduce_: tag_base ", tag_base, " leaves no room for ", 2 * chunks, " tags");
  TORCH_CHECK(exact_block >= 0 && headroom >= 0, "flatcomm: p2p_sum_all_reduce_: exact_block and headroom must be ",
              ">= 0, got ", exact_block, " and ", headroom);
  P2pAllReduce(flat, scratch, pg, pieces, chunks, scale, static_cast<int>(tag_base), exact_block, headroom).run();
}

namespace {

void p2p_sum_all_reduce_op(const at::Tensor& flat, const at::Tensor& scratch, c10::string_view group,
                           at::IntArrayRef pieces, int64_t chunks, double scale, int64_t tag_base,
                           int64_t exact_block, int64_t headroom) {
  p2p_sum_all_reduce_(flat, scratch, cpu_backend(group), pieces, chunks, scale, tag_base, exact_block, headroom);
}

}  // namespace

TORCH_LIBRARY_IMPL(flatcomm, CPU, m) {
  m.impl("p2p_sum_all_reduce_", &p2p_sum_all_reduce_op);
}

}  // namespace ops
}  // namespace flatcomm
