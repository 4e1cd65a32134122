"""A zfunc state, or a checkpoint of one, written as a Hugging Face model folder, one unit at a time.

``save_hf(state, dir)`` (every rank calls it) gathers each unit in turn on every rank, as
``zf.gather_params`` does (reading it from its swap files under ``offload_nvme``), and rank 0
writes its tensors and drops them before the next unit is gathered. ``export_saved(saved, dir)``
(one process) reads each unit's shards from every saved rank's file, joins them, writes them and
drops them, whatever world size and composition saved it. Either way no more than one unit is in
memory at once; the folder is written by ``zfunc.checkpoint.hf_files``, as ``save_pretrained`` writes it.

What goes in: each parameter once, under its first name in module order, the name Hugging
Face keeps for tied weights (GPT-2's and Qwen2's ``...embed_tokens``/``wte`` rather than
``lm_head.weight``, T5's ``shared.weight``); the persistent buffers; not the buffers registered
with ``persistent=False`` (Llama's rotary ``inv_freq``), which ``state_dict`` leaves out too.

In which dtype: ``dtype=None`` writes each parameter in the dtype the model had when
``step.init`` took it (its unit's dtype: fp32 for a model trained under
``mixed_precision(..., bf16)``, whose fp32 master weights are written; bf16 for a model built
in bf16, its master weights cast to it); frozen parameters their stored values in that dtype;
buffers as the state holds them. A ``dtype`` casts every floating-point tensor to it. The
values equal ``zf.gather_params(state)`` cast to the dtype written, bit for bit.

Into a folder that holds another model: files this save writes anew are replaced, as
``save_pretrained`` does; files of a model it would leave beside them (a ``config.json`` without
``config=``, a ``generation_config.json``, shards and indexes of another split, ``pytorch_model*.bin``,
adapter files: whatever ``from_pretrained`` or peft would read with the new weights) make it refuse
before anything is written, unless ``overwrite=True``, which removes them once the new weights are
complete. Other files (a README, the tokenizer's) are kept.

A peft model's state (``model=`` the ``PeftModel``) is written as peft writes it: its adapters as
``PeftModel.save_pretrained`` does, or (``merged=True``) the model ``merge_and_unload()`` gives;
``peft_export`` says what goes in, the same rules write it. Without ``model=`` such a state is refused:
its names (``base_model.model.``, ``base_layer``) load neither as a base model nor as an adapter.
"""
from __future__ import annotations

import math
import os
import re
from collections import Counter

import torch

from .. import dist, swap
from . import peft_export
from .files import dtype_of, free_space_error, fsync_dir, write_text
from .hf_files import CONFIG, INDEX, ModelFolder, Planned, SafetensorsFile, config_dict
from .stream import named_values, plan_tensors


def save_hf(state, directory: str, *, dtype: torch.dtype | None = None, max_shard_size: int | str = "5GB",
            config=None, overwrite: bool = False, model=None, merged: bool = False, selected_adapters=None,
            save_embedding_layers="auto") -> str:
    """Write ``state``'s weights as a Hugging Face model folder ``directory`` (every rank calls it; rank 0
    writes); returns ``directory``. ``max_shard_size``: bytes, or ``"5GB"``, ``"500MB"``; ``config``: a
    ``PretrainedConfig``, a dict, a folder holding ``config.json`` or a JSON file, written as
    ``config.json``; ``overwrite``: remove another model's files this save would leave in ``directory``
    (else they are refused). See the module docstring for the names and dtypes written.

    A peft model's state (``model=``: the ``PeftModel`` ``step.init`` took): its adapters as
    ``PeftModel.save_pretrained`` writes them (``selected_adapters``, ``save_embedding_layers`` as
    there), or with ``merged=True`` the model ``merge_and_unload()`` gives, as its base class's
    ``save_pretrained`` writes it (``config`` defaults to the base model's). See ``peft_export``."""
    swap.check_state(state)
    spec = state.params.spec
    if model is not None:
        spec.model.check_model(model)
    if peft_export.is_peft(model):
        return _save_peft(state, directory, model, merged=merged, selected_adapters=selected_adapters,
                          save_embedding_layers=save_embedding_layers, dtype=dtype, max_shard_size=max_shard_size,
                          config=config, overwrite=overwrite)
    if merged or selected_adapters is not None:
        raise ValueError("save_hf: merged= and selected_adapters= are for a peft model: pass model=, the PeftModel "
                         "(peft.get_peft_model's) that step.init took" + ("" if model is None else
                                                                         f"; {type(model).__name__} is none"))
    if model is None and peft_export.looks_like_peft(n for n, _ in spec.model.owner):
        raise ValueError("save_hf: this state is a peft model's (its names are under 'base_model.model.'), which "
                         "no from_pretrained loads as they are: pass model=, the PeftModel step.init took, to write "
                         "its adapters as PeftModel.save_pretrained does, and merged=True for the merged model")
    plan, parameters, values = named_values(state, dtype, "cpu")
    return _write(directory, plan, parameters, max_shard_size, config, values, spec.process_group,
                  collective=True, overwrite=overwrite)


def _save_peft(state, directory: str, model, *, merged: bool, selected_adapters, save_embedding_layers, dtype,
               max_shard_size, config, overwrite: bool) -> str:
    group = state.params.spec.process_group
    if merged:
        if selected_adapters is not None:
            raise ValueError("save_hf(merged=True) merges the active adapters, as merge_and_unload() does: choose "
                             "them with model.set_adapter (or base_model.set_adapter for several), not "
                             "selected_adapters=")
        plan, parameters, values, base_config = peft_export.merged_model(state, model, dtype)
        return _write(directory, plan, parameters, max_shard_size, base_config if config is None else config, values,
                      group, collective=True, overwrite=overwrite)
    if config is not None:
        raise ValueError("save_hf(model=peft_model) writes the adapters with their adapter_config.json, from the "
                         "model's peft config: config= is for the model's config.json (merged=True)")
    folders = peft_export.adapter_folders(state, model, selected_adapters, save_embedding_layers, dtype)
    return _write_adapters(directory, folders, group, overwrite=overwrite)


def _write_adapters(directory: str, folders, group, *, overwrite: bool) -> str:
    """Each adapter's folder as ``PeftModel.save_pretrained`` writes it, while every rank runs through its
    values (gathers) and rank 0 writes. As a model folder: another model's files refused before anything is
    written, or (``overwrite``) removed once the new weights are complete; the old weights go before the
    new config and weights take their names, so a kill never leaves old weights under a new config."""
    files, error, stale = [], None, {}
    if dist.rank(group) == 0:
        try:
            for f in folders:
                out = os.path.join(directory, f.subfolder)
                os.makedirs(out, exist_ok=True)
                stale[out] = sorted(e for e in os.listdir(out) if e not in (peft_export.ADAPTER_WEIGHTS,
                                                                             peft_export.ADAPTER_CONFIG)
                                    and (e in _MODEL_CONFIGS or _MODEL_WEIGHTS.fullmatch(e))
                                    and os.path.isfile(os.path.join(out, e)))
            found = {os.path.relpath(out, directory): names for out, names in stale.items() if names}
            if found and not overwrite:
                raise FileExistsError(
                    f"{directory!r} holds another model's files that this adapter save would leave beside its "
                    f"adapter, and from_pretrained or peft would read: {found}. Pass overwrite=True to remove "
                    "them, or write into another folder; nothing was written")
            error = free_space_error(directory, sum(t.nbytes for f in folders for t in f.plan), "a peft adapter")
            if error is None:
                files = [SafetensorsFile(os.path.join(directory, f.subfolder, peft_export.ADAPTER_WEIGHTS), f.plan)
                         for f in folders]
        except Exception as e:
            error = e
    _agree(error, directory, group, True)
    for k, f in enumerate(folders):
        for name, t in f.values():
            if files and error is None:
                try:
                    files[k].put(name, t)
                except Exception as e:
                    error = e
            del t  # not held while the next unit is gathered
    if files and error is None:
        try:
            for out_file in files:
                out_file.seal()
            for f, out_file in zip(folders, files):
                out = os.path.join(directory, f.subfolder)
                _remove(out, stale[out])
                if os.path.exists(out_file.path):  # the old weights go before the new config names them
                    os.remove(out_file.path)
                    fsync_dir(out)
                write_text(os.path.join(out, peft_export.ADAPTER_CONFIG), f.config_text)
                out_file.publish()
                fsync_dir(out)
        except Exception as e:
            error = e
    if files and error is not None:
        for out_file in files:
            out_file.abort()
    _agree(error, directory, group, True)
    return directory


def export_saved(saved, directory: str, *, dtype: torch.dtype | None = None, max_shard_size: int | str = "5GB",
                 config=None, overwrite: bool = False) -> str:
    """Write checkpoint ``saved`` (a ``zfunc.checkpoint.Saved``, any world size and composition) as a
    Hugging Face model folder, in one process; returns ``directory``. Arguments as ``save_hf``."""
    plan, parameters, values = _from_saved(saved, dtype)
    return _write(directory, plan, parameters, max_shard_size, config, values, None, collective=False,
                  overwrite=overwrite)


def safetensors_from_saved(saved, path: str, dtype: torch.dtype) -> str:
    """Checkpoint ``saved`` as one ``.safetensors`` file ``path``: the names, tensors and bytes of
    ``export_saved``'s ``model.safetensors``, never sharded (``consolidate --safetensors``)."""
    plan, _, values = _from_saved(saved, dtype)
    folder = os.path.dirname(os.path.abspath(path))
    error = free_space_error(folder, sum(t.nbytes for t in plan), "a safetensors file")
    if error is not None:
        raise error
    out = SafetensorsFile(path, plan)
    try:
        for name, t in values:
            out.put(name, t)
            del t  # not held while the next unit is read
        out.seal()
        out.publish()
    except BaseException:
        out.abort()
        raise
    return path


def entry_offsets(segment: dict) -> list[int]:
    """Where each entry of a manifest's segment starts in its flat buffer: as recorded (an owner
    layout leaves gaps: zfunc.tree._segment), or one after another (checkpoints saved before)."""
    if "offsets" in segment:
        return list(segment["offsets"])
    sizes = [math.prod(shape) for _, shape in segment["entries"]]
    return [sum(sizes[:k]) for k in range(len(sizes))]


def _from_saved(saved, dtype):
    """``(plan, parameter elements, values)`` of checkpoint ``saved``: ``values`` yields each tensor,
    reading one unit at a time and releasing what was read of the files after each."""
    manifest, layouts = saved.manifest, saved.layouts
    trainable = "master" if "master" in layouts else "params"  # the fp32 weights, when mixed precision kept them
    pieces, segments, offsets = [], [], {}
    for i, unit in enumerate(manifest["model"]["units"]):
        for role, kind in ((trainable, "trainable"), ("frozen", "frozen")):
            pieces.append((role, i, unit[kind]["entries"]))
            offsets[(role, i)] = entry_offsets(unit[kind])
            segments.append((unit[kind]["entries"], dtype_of(unit[kind]["dtype"])))
    transient = set(manifest.get("transient_buffers", ()))  # saved by zfunc before they were recorded: none
    keys = manifest.get("state_dict_keys")  # an engine's checkpoint: the model's state_dict names
    buffers = []
    for role, lay in layouts.items():
        name = role[len("buffers['"): -len("']")]
        kept = name not in transient and (keys is None or name in keys)
        if role.startswith("buffers['") and lay == "tensor" and kept:
            entry = saved.files[0].entry(role)
            buffers.append((role, name, tuple(entry["shape"]), dtype_of(entry["dtype"])))
    plan, parameters = plan_tensors(segments, [b[1:] for b in buffers], dtype)
    dtypes = {t.name: t.dtype for t in plan}

    def values():
        for role, i, entries in pieces:
            if not entries:
                continue
            flat = saved.unit(role, i)
            saved.release()  # the file's pages it came from
            for (name, shape), offset in zip(entries, offsets[(role, i)]):
                yield name, flat[offset: offset + math.prod(shape)].view(shape).to(dtypes[name])
            del flat
        for role, name, _, _ in buffers:
            yield name, saved.tensor(role).to(dtypes[name])

    return plan, parameters, values()


# what from_pretrained (or peft) reads as a model's config or weights, beside or instead of ours
_MODEL_CONFIGS = (CONFIG, "generation_config.json", "adapter_config.json")
_MODEL_WEIGHTS = re.compile(r".+\.safetensors|.+\.safetensors\.index\.json|pytorch_model.*\.bin|.+\.bin\.index\.json|"
                            r"adapter_model.*\.bin|tf_model.*\.h5|flax_model.*\.msgpack")


def _stale(directory: str, folder: ModelFolder, config_files) -> list[str]:
    """Another model's files in ``directory`` that this save would leave beside what it writes."""
    writes = set(folder.shards) | ({INDEX} if len(folder.shards) > 1 else set()) | set(config_files)
    if folder.config is not None:
        writes.add(CONFIG)
    try:
        entries = os.listdir(directory)
    except FileNotFoundError:
        return []
    return sorted(e for e in entries if e not in writes and (e in _MODEL_CONFIGS or _MODEL_WEIGHTS.fullmatch(e))
                  and os.path.isfile(os.path.join(directory, e)))


def _remove(directory: str, names: list[str]) -> None:
    """Remove ``names``, the indexes first: a kill midway leaves no index naming a removed shard."""
    for name in sorted(names, key=lambda n: not n.endswith(".index.json")):
        os.remove(os.path.join(directory, name))


def _write(directory: str, plan: list[Planned], parameters: Counter, max_shard_size, config, values, group, *,
           collective: bool, overwrite: bool = False) -> str:
    """Write the folder from ``values``, in this process alone, or (``collective``) while every rank of
    ``group`` runs through ``values`` (their gathers are collectives) and rank 0 writes: an error on
    rank 0 is then raised on every rank once the others are done. Another model's files are refused
    before anything is written, or (``overwrite``) removed once every shard is complete."""
    folder, error, stale = None, None, []
    if not collective or dist.rank(group) == 0:
        try:
            os.makedirs(directory, exist_ok=True)
            # config.json's dtype: the one most parameters are written in (from_pretrained loads in it)
            weights_dtype = parameters.most_common(1)[0][0] if parameters else torch.float32
            cfg, files = (None, {}) if config is None else config_dict(config, weights_dtype)
            folder = ModelFolder(directory, plan, max_shard_size=max_shard_size, parameters=sum(parameters.values()),
                                 config=cfg, config_files=files)
            stale = _stale(directory, folder, files)
            if stale and not overwrite:
                raise FileExistsError(
                    f"{directory!r} holds another model's files that this save would leave beside its weights, and "
                    f"from_pretrained would read: {stale}" + (" (give config= to write config.json anew)"
                                                             if CONFIG in stale else "")
                    + ". Pass overwrite=True (--overwrite) to remove them, or write into another folder; "
                    "nothing was written")
            error = free_space_error(directory, folder.total_bytes, "a Hugging Face model")
        except Exception as e:
            error = e
    _agree(error, directory, group, collective)
    for name, t in values:
        if folder is not None and error is None:
            try:
                folder.put(name, t)
            except Exception as e:
                error = e
        del t  # not held while the next unit is gathered
    if folder is not None and error is None:
        try:
            _remove(directory, stale)  # every new shard is complete (not yet under its name)
            folder.close()
        except Exception as e:
            error = e
    if folder is not None and error is not None:
        folder.abort()
    _agree(error, directory, group, collective)
    return directory


def _agree(error: Exception | None, directory: str, group, collective: bool) -> None:
    """Raise ``error``; ``collective``: on every rank of ``group`` if rank 0 failed."""
    if not collective:
        if error is not None:
            raise error
        return
    failed = torch.tensor([float(error is not None)], dtype=torch.float64, device=dist.device_of(group))
    dist.all_reduce_sum(failed, group)
    if error is not None:
        raise error
    if failed.item():
        raise RuntimeError(f"rank 0 could not write the Hugging Face model {directory!r}; its error says why")
