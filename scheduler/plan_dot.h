// A compiled program as a Graphviz digraph (DOT text): parameters (donated
// ones marked, with the output each becomes), fusions as boxes listing
// their ops, collectives in colour with their axes, bytes and reasons, the
// outputs; the functions control flow runs as dashed clusters. Pure.
#pragma once

#include <string>

#include "scheduler/compiler.h"

namespace tessel::scheduler {

std::string PlanDot(const CompiledProgram& compiled);

}  // namespace tessel::scheduler
