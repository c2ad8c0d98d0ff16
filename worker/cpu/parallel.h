// ParallelFor: a kernel's independent pieces run on the process's kernel
// threads, which start once and wait for work (no thread started per call).
// The caller runs pieces too: when every helper is busy with another
// device's kernel, it runs them all itself, so a call never waits for a
// helper to come free and the cores are never oversubscribed.
#pragma once

#include "absl/functional/function_ref.h"

namespace tessel::cpu {

// Runs fn(0) .. fn(pieces - 1), each once, on the caller and up to
// threads - 1 helpers, and returns when all have returned. Pieces are
// claimed one at a time, so a helper that wakes late (its core busy) takes
// fewer: make several per thread. fn must not call ParallelFor itself.
void ParallelFor(int pieces, int threads, absl::FunctionRef<void(int)> fn);

}  // namespace tessel::cpu
