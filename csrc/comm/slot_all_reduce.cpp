// A small all-reduce in one exchange, natively: the values ride in this rank's call header row (its
// payload slot, flatcomm/comm/small.py), every rank's row is gathered, and when the exchange
// completes the rows are compared and the payloads summed into the tensor, in C++ on gloo's thread:
// ordered in ascending rank order (decode_sum's fp32 arithmetic, p2p_all_reduce.h ordered_sum; bf16
// and fp16 values travel in their own dtype, as the codec of that name encodes them, and the fp32 sum
// is copied into the tensor with ATen's copy_, as the Python path rounds it), or exact mode (fp32,
// bf16, fp16) with the exact_sum op, times scale, copied into the tensor (the Python small path's
// ATen ops, so its bits).
// Python's part of a call is only its post; a disagreement or a failed exchange goes to
// flatcomm.comm.native_calls.verdict for the header's error, the same on every rank.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "../core/common.h"
#include "header_rows.h"
#include "lane.h"
#include "native_work.h"
#include "p2p_all_reduce.h"

#include <cstring>
#include <string>
#include <vector>

namespace flatcomm {
namespace ops {
namespace {

bool half_width(at::ScalarType dtype) { return dtype == at::kBFloat16 || dtype == at::kHalf; }

// The payload of n bf16 / fp16 values as the codec of their dtype writes it: each value through fp32
// and back (the encoder's load and store, csrc/core/common.h), so a NaN is quieted as there.
void encode_half(const uint16_t* x, int64_t n, bool bf16, uint16_t* payload) {
  for (int64_t i = 0; i < n; ++i)
    payload[i] = bf16 ? core::f32_to_bf16(core::bf16_to_f32(x[i])) : core::f32_to_f16(core::f16_to_f32(x[i]));
}

// decode_sum of bf16 / fp16 payloads: each row decoded to fp32 (exactly), summed in rank order and
// scaled (ordered_sum), then rounded into `into` by ATen's copy_, as flatcomm/comm/small.py does.
void ordered_half_sum_into(const char* base, int64_t stride, int64_t world, float scale, at::Tensor& into) {
  const int64_t n = into.numel();
  const bool bf16 = into.scalar_type() == at::kBFloat16;
  at::Tensor decoded = at::empty({world, n}, into.options().dtype(at::kFloat));
  std::vector<const float*> rows;
  for (int64_t r = 0; r < world; ++r) {
    const auto* h = reinterpret_cast<const uint16_t*>(base + r * stride);
    float* d = decoded.data_ptr<float>() + r * n;
    for (int64_t i = 0; i < n; ++i) d[i] = bf16 ? core::bf16_to_f32(h[i]) : core::f16_to_f32(h[i]);
    rows.push_back(d);
  }
  at::Tensor total = at::empty({n}, decoded.options());
  ordered_sum(rows, scale, n, total.data_ptr<float>());
  into.copy_(total);
}

c10::intrusive_ptr<c10d::Work> slot_all_reduce(const at::Tensor& flat, const at::Tensor& out, c10::string_view group,
                                               const at::Tensor& table, const at::Tensor& mine, int64_t width,
                                               int64_t slot_offset, double scale, int64_t token, int64_t lane,
                                               int64_t exact_block, int64_t headroom) {
  check_rows(table, mine, width, "slot_all_reduce");
  const auto dtype = flat.scalar_type();
  const bool exact = exact_block > 0;
  TORCH_CHECK(flat.device().is_cpu() && flat.is_contiguous() &&
                  (dtype == at::kFloat || half_width(dtype)),
              "flatcomm: slot_all_reduce takes a contiguous CPU fp32, bf16 or fp16 tensor, got ",
              flat.toString(), " ", flat.sizes());
  const int64_t n = flat.numel(), row_bytes = mine.numel() * 8, nbytes = n * flat.element_size();
  TORCH_CHECK(slot_offset >= width * 8 && slot_offset % 8 == 0 && slot_offset + nbytes <= row_bytes,
              "flatcomm: slot_all_reduce: ", n, " values at byte ", slot_offset, " do not fit the slot of a ", row_bytes,
              "-byte row");
  auto target = lane_for_post(lane);
  auto backend = cpu_backend(group);
  auto work = c10::make_intrusive<NativeWork>(out, token);
  const float fscale = static_cast<float>(scale);
  // Aliases (header_rows.h): what the callback holds is dropped on gloo's thread.
  at::Tensor into = alias_of(flat).view({-1}), rows = alias_of(table), row = alias_of(mine);
  c10::intrusive_ptr<c10d::Work> exchange;
  // Python posts this call only while no call of the group is in flight (flatcomm/comm/worker.py):
  // it reads its values now and writes them when every row is in, in call order.
  lane_admit(*target, [&] {
    char* slot = reinterpret_cast<char*>(mine.data_ptr<int64_t>()) + slot_offset;
    if (!exact && half_width(dtype))
      encode_half(static_cast<const uint16_t*>(flat.data_ptr()), n, dtype == at::kBFloat16,
                  reinterpret_cast<uint16_t*>(slot));
    else
      std::memcpy(slot, flat.data_ptr(), nbytes);
    exchange = gather_rows(backend, rows, row, "slot_all_reduce");
  });
  exchange->getFuture()->addCallback(
      [work, into, table = rows, mine = row, width, slot_offset, fscale, scale, exact_block, headroom, token,
       target](c10::ivalue::Future& done) mutable {
        const std::exception_ptr failed = done.hasError() ? done.exception_ptr() : nullptr;
        if (failed || !rows_agree(table, mine, width)) {
          work->settle(verdict(token, nullptr, failed), [&] { lane_finished(*target); });
          release_work(work);
          return;
        }
        const char* base = reinterpret_cast<const char*>(table.data_ptr<int64_t>()) + slot_offset;
        const int64_t world = table.size(0), stride = table.size(1) * 8;
        std::exception_ptr error;
        try {
          if (exact_block > 0) {
            std::vector<const void*> payloads;
            for (int64_t r = 0; r < world; ++r) payloads.push_back(base + r * stride);
            exact_sum_into(payloads, into.numel(), scale, exact_block, headroom, into);
          } else if (into.scalar_type() != at::kFloat) {
            ordered_half_sum_into(base, stride, world, fscale, into);
          } else {
            std::vector<const float*> payloads;
            for (int64_t r = 0; r < world; ++r) payloads.push_back(reinterpret_cast<const float*>(base + r * stride));
            ordered_sum(payloads, fscale, into.numel(), into.data_ptr<float>());
          }
        } catch (...) {  // (checked in Python before the post: a failure here is a bug, raised at wait)
          error = std::current_exception();
        }
        work->settle(error, [&] { lane_finished(*target); });
        release_work(work);
      });
  return work;
}

}  // namespace

TORCH_LIBRARY_IMPL(flatcomm, CPU, m) {
  m.impl("slot_all_reduce", &slot_all_reduce);
}

}  // namespace ops
}  // namespace flatcomm
