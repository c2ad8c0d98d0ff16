"""tessel.Compiled: what the coordinator answered to a compile — the
executable, its per-device plan and diagnostics."""

from tessel.v1 import ir_pb2


class Compiled:
    """What Compile answered: the executable, its per-device plan and the
    coordinator's diagnostics."""

    def __init__(self, response):
        self._r = response
        self.executable_id = response.executable_id
        self.cache_hit = response.cache_hit
        self.cache_miss_reason = response.cache_miss_reason
        self.diagnostics = list(response.diagnostics)
        self.estimated_bytes = response.estimated_bytes
        self.aliases = [{"parameter": a.parameter, "output": a.output, "reason": a.reason} for a in response.aliases]
        self.input_types = [type_text(t) for t in response.parameter_types]
        self.output_types = [type_text(t) for t in response.output_types]
        # Partitioned: the collectives inserted, each with its reason.
        self.collectives = [
            {
                "value": c.value,
                "op": c.op,
                "axes": tuple(c.axes),
                "bytes_per_device": c.bytes_per_device,
                "reason": c.reason,
            }
            for c in response.collectives
        ]
        # An MPMD program: the values moved between its mesh regions, worker to worker.
        self.transfers = [{"value": t.value, "bytes": t.bytes, "reason": t.reason} for t in response.transfers]

    def as_text(self):
        """The per-device program, as the coordinator prints it."""
        return self._r.plan

    def __repr__(self):
        return f"Compiled({self.executable_id}, {', '.join(self.input_types)} -> {', '.join(self.output_types)})"


def type_text(t):
    """A TensorType as text: f32[2,3]."""
    return f"{ir_pb2.DType.Name(t.dtype).lower()}[{','.join(str(d) for d in t.dims)}]"
