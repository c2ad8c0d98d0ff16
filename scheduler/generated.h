// Layout ops over generated values, pushed into them.
//
// A fill, an iota, and elementwise ops and scalar broadcasts over them are
// generated where they are used: each device computes its own block (the
// partitioner regenerates them in the layout their readers want), and
// nothing of them is shipped or kept whole. A layout op applied to one
// (slice, reshape, transpose, broadcast_in_dim) would make the whole value
// first and then cut or move it: `zeros((2**26,))[:2**20]` or
// `arange(n*n).reshape(n, n)` would hold the full constant on every device.
// This pass pushes the layout op into the generated expression, so that its
// result is generated too:
//   - a fill becomes a fill of the result's shape;
//   - an iota along d becomes an iota of the result's shape along the
//     dimension d lands on (transpose, broadcast_in_dim; a broadcast of an
//     extent-1 dimension is a fill of 0), times the slice's stride plus its
//     start (slice), or for a reshape the operand's index along d recovered
//     from the result's flat position, (flat / stride_d) % extent_d. The
//     index arithmetic runs in s32 (s64 from 2^31 elements) and is
//     converted once, so values are exactly the original's;
//   - an elementwise op or a scalar broadcast becomes the same op over its
//     operands with the layout op pushed in (rank-0 operands stay).
// Each rewritten node keeps its name, so its readers are unchanged.
//
// Thread-safety: a pure function of its argument.
#pragma once

#include "tessel/v1/ir.pb.h"

namespace tessel::scheduler {

// Rewrites the top-level nodes of `g` (a validated graph: every node has its
// type). Returns whether it rewrote any.
bool PushLayoutsIntoGenerated(v1::Graph& g);

}  // namespace tessel::scheduler
