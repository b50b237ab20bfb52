"""The quantization ops under torch.compile(fullgraph=True) with a dynamic token dimension."""

import expecttest
import torch

import fp4moe  # noqa: F401
from compile_tests.graph_capture import RecordingBackend

ops = torch.ops.fp4moe


def quantize_round_trip(x: torch.Tensor, w_global_scale: torch.Tensor):
    """Per-token activation quantization through the aux-amax handoff, then dequantization."""
    amax = ops.tile_amax(x, 64)
    codes, block_scales, per_token_scale = ops.quantize_per_token(x, input_amax=amax, sf_layout="linear")
    x_hat = ops.dequantize(codes, block_scales, "linear", per_token_scale=per_token_scale)
    w_codes, w_scales = ops.quantize(x_hat, w_global_scale, four_over_six="mse")
    return x_hat, w_codes, w_scales


class TestCompileQuantize(expecttest.TestCase):
    def setUp(self):
        torch._dynamo.reset()

    def test_fullgraph_dynamic_tokens_one_graph(self):
        backend = RecordingBackend()
        compiled = torch.compile(quantize_round_trip, backend=backend, fullgraph=True)
        gs = torch.tensor([7.0])
        for tokens in (17, 33, 64):
            x = torch.randn(tokens, 256, dtype=torch.bfloat16)
            torch._dynamo.mark_dynamic(x, 0)
            actual = compiled(x, gs)
            expected = quantize_round_trip(x, gs)
            for a, e in zip(actual, expected):
                self.assertTrue(torch.equal(a.view(torch.uint8), e.view(torch.uint8)))
        self.assertEqual(len(backend.graphs), 1)  # one graph serves every token count
        self.assertExpectedInline(
            backend.fp4moe_calls(),
            """\
fp4moe.tile_amax(bfloat16[S0, 256], 64)
fp4moe.quantize_per_token(bfloat16[S0, 256], input_amax=bfloat16[((S0 + 7)//8), 4, 8], sf_layout='linear')
fp4moe.dequantize(uint8[S0, 128], float8_e4m3fn[S0, 16], 'linear', per_token_scale=float32[S0])
fp4moe.quantize(bfloat16[S0, 256], float32[1], four_over_six='mse')""",
        )


if __name__ == "__main__":
    expecttest.run_tests()
