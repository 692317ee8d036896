// Scoring options shared by the SnapKV and H2O kernels (kept apart so bindings can parse them
// without pulling in the kernels).
#pragma once

namespace ripplekv {

enum class Pooling : int { kMax = 0, kAvg = 1 };             // 1-D pooling of scores along positions
enum class GroupReduce : int { kMean = 0, kMax = 1 };         // over the query heads sharing a KV head

}  // namespace ripplekv
