"""The random Llama the weight-loading benchmarks write and read back (load_weights.py,
hf_weights_peers.py): tied embeddings, 64-wide heads, 2 query heads per key-value head."""
import torch


def llama(args, device: str):
    """A LlamaForCausalLM of ``args.layers`` layers of ``args.width``, vocabulary ``args.vocab``, on ``device``."""
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=args.vocab, hidden_size=args.width, intermediate_size=args.width * 11 // 4,
                                   num_hidden_layers=args.layers, num_attention_heads=args.width // 64,
                                   num_key_value_heads=max(1, args.width // 128), max_position_embeddings=256,
                                   tie_word_embeddings=True)
    with torch.device(device):
        return transformers.LlamaForCausalLM(cfg)
