// The psum the benchmarks time against Gloo and NCCL called directly: an
// f32 block of `per_device` elements on each device of a {x: 2} mesh, made
// on the devices (nothing uploaded), and a step that all-reduces it in a
// manual region over x, donated, in place: one collective per step.
// Header-only; each benchmark compiles it in its own session.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "core/status.h"
#include "tessel/graph.h"
#include "tessel/session.h"

namespace tessel::bench {

struct PsumPrograms {
  Executable init;  // no arguments: the state, ones
  Executable step;  // state -> state, donated
};

inline absl::StatusOr<PsumPrograms> CompilePsum(Session& session, int64_t per_device) {
  const Mesh pair({{"x", 2}});
  const Sharding split = Sharding::Split({"x"});
  GraphBuilder init("ones");
  TESSEL_ASSIGN_OR_RETURN(Graph ones,
                          init.Build({init.Fill({DType::kF32, {2 * per_device}}, 1.0)}));
  PsumPrograms p;
  TESSEL_ASSIGN_OR_RETURN(p.init,
                          session.Compile(ones, {.mesh = pair, .output_shardings = {split}}));
  GraphBuilder g("psum");
  auto a = g.Parameter({DType::kF32, {2 * per_device}}, "a");
  auto r = g.ManualRegion(
      pair, {a}, {split}, split,
      [](GraphBuilder& b, const std::vector<Value>& in) { return b.AllReduce(in[0], {"x"}); });
  TESSEL_ASSIGN_OR_RETURN(Graph psum, g.Build({r}));
  TESSEL_ASSIGN_OR_RETURN(p.step, session.Compile(psum, {.donate = {0},
                                                         .strict_donation = true,
                                                         .mesh = pair,
                                                         .parameter_shardings = {split},
                                                         .output_shardings = {split}}));
  if (p.step.collectives().size() != 1)
    return absl::InternalError("psum plan: expected one collective");
  return p;
}

}  // namespace tessel::bench
