"""Test setup: an 8-device CPU platform before JAX starts, and the tiny reference model pair."""

import os

# Must precede the first `import jax` anywhere in the test session.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def tiny_pair():
    """(reference torch model, our NNX model, cfg) with identical random weights, float32.

    Norm scales and biases are randomized too (the reference initializes them to 1 and 0, which
    would hide a transposed or dropped bias).
    """
    torch = pytest.importorskip("torch")
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    from codedance_jax.checkpoint.build import model_from_tensors
    from codedance_jax.model.config import ModelConfig
    from codedance_jax.model.params import canonical_hf_name

    cfg = ModelConfig.tiny()
    torch.manual_seed(1234)
    ref = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(**cfg.to_hf_config())).eval()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            base = 1.0 if ("norm" in name or "ln_q" in name) else 0.0
            p.copy_(base + 0.05 * torch.randn_like(p))
    sd = {canonical_hf_name(k): v.detach().numpy() for k, v in ref.state_dict().items()}
    ours = model_from_tensors(cfg, lambda r: sd[r.hf_name])
    return ref, ours, cfg
