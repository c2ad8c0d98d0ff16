// `tessel checkpoint ls DIRECTORY | inspect PATH [--verify]`.
#pragma once

#include <string>
#include <vector>

namespace tessel::cli {

// `operands`: the subcommand and the path. Returns the exit status: with
// `verify`, 1 when a chunk is missing, torn or corrupt.
int CheckpointCommand(const std::vector<std::string>& operands, bool verify);

}  // namespace tessel::cli
