#include "server/block_layout.h"

#include "core/dtype.h"
#include "core/sharding.h"

namespace tessel::server {

BlockLayout::BlockLayout(const v1::TensorType& global, const v1::Sharding& s,
                         const v1::Mesh& mesh) {
  const int rank = global.dims_size();
  std::vector<int64_t> blocks(rank, 1);
  int last_split = -1;
  for (int d = 0; d < rank && d < s.dims_size(); ++d) {
    blocks[d] = AxesSize(mesh, s.dims(d).axes());
    if (blocks[d] > 1) last_split = d;
  }
  blocks_per_dim_ = blocks;
  // Block ids: row-major over the per-dimension block indices.
  std::vector<int64_t> stride(rank, 1);
  int64_t total = 1;
  for (int d = rank - 1; d >= 0; --d) {
    stride[d] = total;
    total *= blocks[d];
  }
  positions_of_block_.assign(total, {});
  for (int p = 0; p < MeshSize(mesh); ++p) {
    const std::vector<int64_t> b = BlockIndex(s, mesh, p);
    int64_t id = 0;
    for (int d = 0; d < rank && d < int(b.size()); ++d) id += b[d] * stride[d];
    positions_of_block_[id].push_back(p);
  }
  const int64_t elem = DTypeSize(global.dtype());
  int64_t inner = 1;
  for (int d = last_split + 1; d < rank; ++d) inner *= global.dims(d);
  if (last_split < 0) {
    run_bytes_ = inner * elem;
    num_runs_ = 1;
    return;
  }
  run_bytes_ = inner * (global.dims(last_split) / blocks[last_split]) * elem;
  for (int d = 0; d < last_split; ++d) {
    radices_.push_back(global.dims(d));
    digit_divisor_.push_back(global.dims(d) / blocks[d]);
    block_stride_.push_back(stride[d]);
    num_runs_ *= global.dims(d);
  }
  radices_.push_back(blocks[last_split]);
  digit_divisor_.push_back(1);
  block_stride_.push_back(stride[last_split]);
  num_runs_ *= blocks[last_split];
}

BlockLayout BlockLayout::Whole(const v1::TensorType& global, int devices) {
  BlockLayout l;
  l.positions_of_block_.assign(1, {});
  for (int i = 0; i < devices; ++i) l.positions_of_block_[0].push_back(i);
  l.run_bytes_ = ByteSizeUnchecked(global);
  return l;
}

void BlockLayout::Box(int b, const v1::TensorType& global, std::vector<int64_t>* start,
                      std::vector<int64_t>* shape) const {
  const int rank = global.dims_size();
  start->assign(rank, 0);
  shape->assign(global.dims().begin(), global.dims().end());
  if (blocks_per_dim_.empty()) return;
  // Block ids are row-major over the per-dimension block indices.
  int64_t id = b;
  for (int d = rank - 1; d >= 0; --d) {
    const int64_t n = blocks_per_dim_[d];
    (*shape)[d] = global.dims(d) / n;
    (*start)[d] = (id % n) * (*shape)[d];
    id /= n;
  }
}

int BlockLayout::BlockOfRun(int64_t run) const {
  int64_t id = 0;
  for (int i = int(radices_.size()) - 1; i >= 0; --i) {
    const int64_t digit = run % radices_[i];
    run /= radices_[i];
    id += digit / digit_divisor_[i] * block_stride_[i];
  }
  return int(id);
}

}  // namespace tessel::server
