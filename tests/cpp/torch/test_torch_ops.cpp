// The op library as a C++ engine sees it: loaded at run time, every op called through the typed entry
// points of csrc/ops.h (the dispatcher underneath), no Python. (Linking alone is not enough: nothing
// references a symbol of the library, so the linker may drop it and its static op registrations would
// never run.)
#include <dlfcn.h>
#include <ATen/ATen.h>

#include <cstdio>

#include "ops.h"

namespace ops = ripplekv_ext::ops;

#define CHECK(cond)                                                                \
  do {                                                                             \
    if (!(cond)) {                                                                 \
      std::fprintf(stderr, "%s:%d: failed: %s\n", __FILE__, __LINE__, #cond);      \
      return 1;                                                                    \
    }                                                                              \
  } while (0)

int main() {
  if (dlopen(RIPPLEKV_OPS_LIBRARY, RTLD_NOW | RTLD_GLOBAL) == nullptr) {
    std::fprintf(stderr, "cannot load %s: %s\n", RIPPLEKV_OPS_LIBRARY, dlerror());
    return 1;
  }
  at::manual_seed(0);
  const auto keys = at::randn({2, 3, 17, 8});
  const auto values = at::randn({2, 3, 17, 8});
  const auto indices = at::randint(0, 17, {2, 3, 5}, at::kLong);
  const auto index = indices.unsqueeze(-1).expand({-1, -1, -1, 8});

  // gather_kv and gather_kv_into against at::gather.
  const auto [k_c, v_c] = ops::gather_kv(keys, values, indices);
  CHECK(at::equal(k_c, keys.gather(2, index)) && at::equal(v_c, values.gather(2, index)));
  auto k_out = at::empty({2, 3, 5, 8}), v_out = at::empty({2, 3, 5, 8});
  ops::gather_kv_into(keys, values, indices, k_out, v_out);
  CHECK(at::equal(k_out, k_c) && at::equal(v_out, v_c));

  // select_topk of distinct scores: the top budget - W prefix positions plus the window, ascending.
  const auto scores = at::randperm(12, at::kFloat).reshape({1, 1, 12});
  const auto kept = ops::select_topk(scores, 7, 5);
  const auto top = std::get<0>(std::get<1>(scores.topk(2, -1)).sort(-1));
  CHECK(at::equal(kept, at::cat({top, at::arange(12, 17, at::kLong).view({1, 1, 5})}, -1)));

  // snapkv_compress = snapkv_scores -> select_topk -> gather_kv.
  const auto q = at::randn({2, 6, 4, 8});
  const auto s = ops::snapkv_scores(q, keys);
  CHECK(s.sizes() == at::IntArrayRef({2, 3, 13}));
  const auto [kc, vc, idx] = ops::snapkv_compress(q, keys, values, 9);
  CHECK(at::equal(idx, ops::select_topk(s, 9, 4)));
  CHECK(at::equal(kc, std::get<0>(ops::gather_kv(keys, values, idx))));

  // h2o_scores: every query's attention sums to 1, so the scores of a row sum to N (mean over the group).
  const auto h = ops::h2o_scores(at::randn({2, 6, 17, 8}), keys);
  CHECK(at::allclose(h.sum(-1), at::full({2, 3}, 17.0f), 1e-4, 1e-3));

  // The packed pair equals the per-layer ops.
  const auto [flat, offsets] = ops::select_topk_packed(at::stack({s, s.flip(-1)}), {9, 6}, 4);
  CHECK(at::equal(offsets, at::tensor({0, 9, 15}, at::kLong)));
  const auto [kp, vp] = ops::gather_kv_packed({keys, values}, {values, keys}, flat, offsets);
  CHECK(at::equal(kp.narrow(2, 0, 9), kc) && at::equal(vp.narrow(2, 0, 9), vc));

  // Per-row ops of a left-padded batch (row 0: all 17 tokens, row 1: its last 10): row 1 equals the row alone,
  // right-aligned with -1 before it, and scores + select_topk_rows equal the compression's indices.
  const auto lengths = at::tensor({17, 10}, at::kLong), budgets = at::tensor({9, 6}, at::kLong);
  const auto [kr, vr, ir] = ops::snapkv_compress_rows(q, keys, values, budgets, lengths);
  CHECK(ir.sizes() == at::IntArrayRef({2, 3, 9}) && kr.sizes() == at::IntArrayRef({2, 3, 9, 8}));
  const auto alone = std::get<2>(ops::snapkv_compress(q.narrow(0, 1, 1), keys.narrow(0, 1, 1).narrow(2, 7, 10),
                                                      values.narrow(0, 1, 1).narrow(2, 7, 10), 6));
  CHECK(at::equal(ir.narrow(0, 1, 1).narrow(2, 3, 6), alone + 7));
  CHECK((ir.narrow(0, 1, 1).narrow(2, 0, 3) == -1).all().item<bool>());
  const auto row_scores = ops::snapkv_scores(q, keys, 7, "max", "mean", std::nullopt, lengths);
  CHECK(at::equal(ops::select_topk_rows(row_scores, budgets, 4, lengths), ir));
  CHECK(at::equal(std::get<0>(ops::gather_kv(keys, values, ir)), kr));

  // Errors surface as c10::Error with the op's message.
  bool raised = false;
  try {
    ops::select_topk(scores, 3, 5);
  } catch (const c10::Error& e) {
    raised = std::string(e.what()).find("budget must be >= window") != std::string::npos;
  }
  CHECK(raised);
  std::printf("ripplekv ops via csrc/ops.h: ok\n");
  return 0;
}
