// The protobuf behind a tessel::Graph.
#pragma once

#include "tessel/graph.h"
#include "tessel/v1/ir.pb.h"

namespace tessel {

class GraphImpl {
 public:
  v1::Graph proto;
};

}  // namespace tessel
