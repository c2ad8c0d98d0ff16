// Donation planning: which outputs a parameter's buffer can become, in place,
// without a copy and without clobbering a value still to be read.
//
// A parameter p can alias output o when they have the same type and either
//  - o is p itself (or a reshape of it), or
//  - o's buffer is written by an instruction k that no later instruction
//    follows with a read of p, and k itself reads p only elementwise (a
//    fusion whose node writing o comes after every node reading p).
// Outputs made by reshapes alias the buffer of the value they reshape.
// Stateless; any thread.
#pragma once

#include <string>
#include <vector>

#include "tessel/v1/program.pb.h"

namespace tessel::scheduler {

struct AliasCandidates {
  // Per parameter: the outputs it may become, in preference order.
  std::vector<std::vector<int>> outputs;
  // Per parameter: why it may become none, or which outputs of its type it
  // may not become and why; empty when nothing to say.
  std::vector<std::string> why_not;
  // Per output: the value whose buffer the output is (after reshapes).
  std::vector<std::string> buffer_of_output;
};

AliasCandidates FindAliasCandidates(const v1::Program& program);

struct AliasDecision {
  int parameter = 0;
  int output = -1;     // -1: not reused
  std::string reason;  // when output is -1
};

// Assigns each donated parameter (in the given order) the first candidate
// output whose buffer no earlier donation took.
std::vector<AliasDecision> AssignAliases(const v1::Program& program,
                                         const AliasCandidates& candidates,
                                         const std::vector<int>& donated_parameters);

}  // namespace tessel::scheduler
