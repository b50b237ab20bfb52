"""A small model (embedding -> FusedMoE -> linear) under torch.compile(fullgraph=True), dynamic tokens."""

import expecttest
import torch
from torch import nn

import fp4moe
from compile_tests.graph_capture import RecordingBackend


class TinyMoEModel(nn.Module):
    def __init__(self, vocab=50, hidden=64, intermediate=32, experts=8, top_k=2, **moe_options):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.embed = nn.Embedding(vocab, hidden, dtype=torch.bfloat16)
        router = torch.randn(experts, hidden, generator=g)
        w1 = torch.randn(experts, 2 * intermediate, hidden, generator=g) / hidden**0.5
        w2 = torch.randn(experts, hidden, intermediate, generator=g) / intermediate**0.5
        self.moe = fp4moe.FusedMoE.from_dense(router, w1, w2, top_k, **moe_options)
        self.head = nn.Linear(hidden, vocab, dtype=torch.bfloat16)

    def forward(self, token_ids):
        return self.head(self.moe(self.embed(token_ids)))


class TestCompileMoE(expecttest.TestCase):
    def setUp(self):
        torch._dynamo.reset()

    def test_fused_moe_model_fullgraph_dynamic_tokens(self):
        model = TinyMoEModel(quant_mode="w4a4", per_token_activation=True, apply_router_weight_on_input=True).eval()
        backend = RecordingBackend()
        compiled = torch.compile(model, backend=backend, fullgraph=True)
        with torch.inference_mode():
            for tokens in (5, 9, 31):
                ids = torch.randint(0, 50, (tokens,))
                torch._dynamo.mark_dynamic(ids, 0)
                self.assertTrue(torch.equal(compiled(ids), model(ids)))
        self.assertEqual(len(backend.graphs), 1)  # no graph breaks, no recompilation per token count
        self.assertExpectedInline(
            backend.fp4moe_calls(),
            """\
fp4moe.route_softmax_topk(bfloat16[S0, 8], 2, True)
fp4moe.fused_moe(bfloat16[S0, 64], int32[S0, 2], float32[S0, 2], uint8[8, 2, 2, 2048], uint8[8, 2, 2, 256], float32[8], uint8[8, 2, 2, 2048], uint8[8, 2, 2, 256], float32[8], None, None, 'w4a4', True, 'swiglu', None, None, None, True, False, 0, weight_layout='sm90', global_num_experts=8)""",
        )

    def test_deepseek_routing_and_deterministic_finalize_compile(self):
        model = TinyMoEModel(
            experts=16, top_k=4, quant_mode="w4a16", routing="deepseek_v3", correction_bias=torch.zeros(16),
            n_group=4, topk_group=2, routed_scaling_factor=2.5, deterministic=True,
        ).eval()
        compiled = torch.compile(model, fullgraph=True, dynamic=True, backend="aot_eager")
        with torch.inference_mode():
            for tokens in (3, 17):
                ids = torch.randint(0, 50, (tokens,))
                self.assertTrue(torch.equal(compiled(ids), model(ids)))


if __name__ == "__main__":
    expecttest.run_tests()
