"""tessel.Compiled: what the coordinator answered to a compile — the
executable, its per-device plan and diagnostics."""

import shutil
import subprocess

from tessel.v1 import ir_pb2


class Compiled:
    """What Compile answered: the executable, its per-device plan and the
    coordinator's diagnostics."""

    def __init__(self, response, session=None):
        self._r = response
        self._session = session
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

    def as_dot(self):
        """The per-device program as a Graphviz digraph (DOT text): fusions as
        boxes, collectives in colour with their bytes and reasons, donated
        parameters marked, the functions control flow runs as clusters."""
        if self._session is None:
            raise ValueError("as_dot: this Compiled has no session to ask")
        return self._session.plan_dot(self.executable_id)

    def as_svg(self):
        """as_dot() drawn by Graphviz's `dot` (which must be installed), as SVG text."""
        dot = shutil.which("dot")
        if dot is None:
            raise FileNotFoundError("as_svg: Graphviz's `dot` is not installed (apt-get install graphviz)")
        return subprocess.run([dot, "-Tsvg"], input=self.as_dot(), capture_output=True, text=True, check=True).stdout

    def __repr__(self):
        return f"Compiled({self.executable_id}, {', '.join(self.input_types)} -> {', '.join(self.output_types)})"


def type_text(t):
    """A TensorType as text: f32[2,3]."""
    return f"{ir_pb2.DType.Name(t.dtype).lower()}[{','.join(str(d) for d in t.dims)}]"
