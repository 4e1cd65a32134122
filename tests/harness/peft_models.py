"""peft models over the tiny Hugging Face models of ``hf.py``: each method's config (LoRA with
``modules_to_save``, gaussian LoRA, IA3, DoRA), the model built on the meta device, a second active LoRA
("two"), and which tensors are adapters; shared by the tests that load, train, export and stream them."""
import peft

from hf import build

TARGETS = {"gpt2": ["c_attn"], "llama": ["q_proj", "v_proj"], "qwen2": ["q_proj", "v_proj", "down_proj"]}
FEEDFORWARD = {"gpt2": ["c_fc"], "llama": ["down_proj"], "qwen2": ["down_proj"]}
OTHER = {"gpt2": ["c_proj"], "llama": ["k_proj", "o_proj"], "qwen2": ["k_proj"]}  # the second LoRA's modules
ADAPTER_PARTS = ("lora_", "ia3_l")


def peft_config(kind: str, method: str):
    if method == "lora":
        return peft.LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS[kind], lora_dropout=0.0,
                               modules_to_save=["lm_head"] if kind == "llama" else None)
    if method == "gaussian":
        return peft.LoraConfig(r=4, target_modules=TARGETS[kind], lora_dropout=0.0, init_lora_weights="gaussian")
    if method == "ia3":
        return peft.IA3Config(target_modules=TARGETS[kind] + FEEDFORWARD[kind], feedforward_modules=FEEDFORWARD[kind])
    if method == "dora":
        return peft.LoraConfig(r=4, target_modules=TARGETS[kind], use_dora=True)
    raise ValueError(method)


def meta_peft(kind: str, method: str):
    return peft.get_peft_model(build(kind, "meta"), peft_config(kind, method))


def make_peft(kind: str, method: str, device: str = "meta"):
    """``method``: one of ``peft_config``'s, or "two": LoRA (``default``) and a second LoRA (``other``,
    other modules) both active and trained."""
    model = peft.get_peft_model(build(kind, device), peft_config(kind, "lora" if method == "two" else method))
    if method == "two":
        model.add_adapter("other", peft.LoraConfig(r=2, lora_alpha=4, target_modules=OTHER[kind], lora_dropout=0.0))
        model.base_model.set_adapter(["default", "other"])
    return model


def is_adapter(name: str) -> bool:
    return any(part in name for part in ADAPTER_PARTS)
