// BlockLayout: where the bytes of a sharded array go. The array's row-major
// bytes fall into runs of `run_bytes`, each wholly inside one block; every
// block receives its runs in increasing order, so Put and Fetch stream
// block by block without holding the whole array. Pure; any thread.
#pragma once

#include <cstdint>
#include <vector>

#include "tessel/v1/ir.pb.h"

namespace tessel::server {

class BlockLayout {
 public:
  // `sharding` normalized and valid for `global` on `mesh`.
  BlockLayout(const v1::TensorType& global, const v1::Sharding& sharding, const v1::Mesh& mesh);
  // The whole array as one block held by `devices` devices.
  static BlockLayout Whole(const v1::TensorType& global, int devices);

  int num_blocks() const { return int(positions_of_block_.size()); }
  // Mesh positions holding block b (copies), ascending.
  const std::vector<int>& positions(int b) const { return positions_of_block_[b]; }
  int64_t run_bytes() const { return run_bytes_; }
  int64_t num_runs() const { return num_runs_; }
  int BlockOfRun(int64_t run) const;
  // The box block b covers: its first index and its extent, per dimension.
  void Box(int b, const v1::TensorType& global, std::vector<int64_t>* start,
           std::vector<int64_t>* shape) const;

 private:
  BlockLayout() = default;
  std::vector<std::vector<int>> positions_of_block_;
  std::vector<int64_t> blocks_per_dim_;  // empty: one block
  std::vector<int64_t>
      radices_;  // run index digits: dims before the last split one, then its blocks
  std::vector<int64_t> digit_divisor_;  // digit -> block index along its dimension
  std::vector<int64_t> block_stride_;   // block index along a digit's dimension -> block id
  int64_t run_bytes_ = 0;
  int64_t num_runs_ = 1;
};

}  // namespace tessel::server
