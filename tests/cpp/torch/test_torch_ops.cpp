// The op library as a C++ engine sees it: loaded at run time, ops found through the dispatcher by
// name, no Python. (Linking alone is not enough: nothing references a symbol of the library, so
// the linker may drop it and its static op registrations would never run.)
#include <dlfcn.h>
#include <torch/torch.h>

#include <cstdio>

int main() {
  if (dlopen(RIPPLEKV_OPS_LIBRARY, RTLD_NOW | RTLD_GLOBAL) == nullptr) {
    std::fprintf(stderr, "cannot load %s: %s\n", RIPPLEKV_OPS_LIBRARY, dlerror());
    return 1;
  }
  auto op = c10::Dispatcher::singleton()
                .findSchemaOrThrow("ripplekv::gather_kv", "")
                .typed<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                          const at::Tensor&)>();
  const auto keys = torch::randn({2, 3, 17, 8});
  const auto values = torch::randn({2, 3, 17, 8});
  const auto indices = torch::randint(0, 17, {2, 3, 5}, torch::kLong);
  const auto [k_c, v_c] = op.call(keys, values, indices);
  const auto index = indices.unsqueeze(-1).expand({-1, -1, -1, 8});
  if (!torch::equal(k_c, keys.gather(2, index)) || !torch::equal(v_c, values.gather(2, index))) {
    std::fprintf(stderr, "gather_kv through the dispatcher differs from torch::gather\n");
    return 1;
  }
  std::printf("ripplekv::gather_kv via dispatcher: ok\n");
  return 0;
}
