// Torch-free test of the CPU gather kernel in include/ripplekv/: what an engine embedding the
// headers without libtorch relies on. Built by CMake (ctest) and by tests/test_cpp_kernels.py.
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "ripplekv/gather_kv.h"

#include "expect.h"

int main() {
  const int64_t B = 2, H = 3, N = 7, D = 5, C = 4;
  std::vector<float> keys(B * H * N * D), values(B * H * N * D);
  for (size_t i = 0; i < keys.size(); ++i) {
    keys[i] = static_cast<float>(i);
    values[i] = -static_cast<float>(i);
  }
  std::vector<int64_t> indices(B * H * C);
  for (int64_t r = 0; r < B * H; ++r)
    for (int64_t t = 0; t < C; ++t) indices[r * C + t] = (r + 2 * t) % N;

  std::vector<float> keys_out(B * H * C * D), values_out(B * H * C * D);
  const ripplekv::Strides4 in{H * N * D, N * D, D, 1}, out{H * C * D, C * D, D, 1};
  ripplekv::GatherKVParams p{keys.data(), values.data(), indices.data(), keys_out.data(),
                             values_out.data(), B, H, N, C, D, in, in, out, out,
                             ripplekv::Strides3{H * C, C, 1}};
  EXPECT(ripplekv::gather_kv_rows<float>(p, 0, B * H).ok());
  for (int64_t r = 0; r < B * H; ++r)
    for (int64_t t = 0; t < C; ++t)
      for (int64_t d = 0; d < D; ++d) {
        const int64_t j = (r + 2 * t) % N;
        EXPECT(keys_out[(r * C + t) * D + d] == static_cast<float>((r * N + j) * D + d));
        EXPECT(values_out[(r * C + t) * D + d] == -static_cast<float>((r * N + j) * D + d));
      }

  // A bad index is reported with its row and value, not read.
  indices[1 * C + 2] = N;
  const ripplekv::Status s = ripplekv::gather_kv_rows<float>(p, 0, B * H);
  EXPECT(s.code == ripplekv::StatusCode::kIndexOutOfRange);
  EXPECT(s.row == 1 && s.value == N);
  std::printf("gather_kv_rows: ok\n");
  return 0;
}
