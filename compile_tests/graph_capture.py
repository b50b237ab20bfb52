"""A torch.compile backend that records the fp4moe ops of each captured graph."""

import re

import torch


class RecordingBackend:
    """Records, for each graph Dynamo hands over, the fp4moe calls in order, then runs the graph eagerly."""

    def __init__(self):
        self.graphs: list[torch.fx.GraphModule] = []

    def __call__(self, gm: torch.fx.GraphModule, example_inputs):
        self.graphs.append(gm)
        return gm.forward

    def fp4moe_calls(self, graph_index: int = -1) -> str:
        """One line per fp4moe call: `op(arg kinds...)`, with symbolic sizes of tensor arguments.

        Dynamo's symbol names (s0, s77, ...) vary between torch versions, so they are renamed in order
        of appearance to S0, S1, ...
        """
        lines = []
        for node in self.graphs[graph_index].graph.nodes:
            if node.op == "call_function" and str(node.target).startswith("fp4moe."):
                args = [_describe(a) for a in node.args] + [f"{k}={_describe(v)}" for k, v in node.kwargs.items()]
                lines.append(f"{node.target}({', '.join(args)})")
        symbols: dict[str, str] = {}
        text = "\n".join(lines)
        return re.sub(r"\bs\d+\b", lambda m: symbols.setdefault(m.group(0), f"S{len(symbols)}"), text)


def _describe(arg):
    if isinstance(arg, torch.fx.Node):
        value = arg.meta.get("example_value")
        if isinstance(value, torch.Tensor):
            return f"{str(value.dtype).removeprefix('torch.')}{list(value.shape)}"
        return arg.name
    return repr(arg)
