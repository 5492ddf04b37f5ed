"""Reversible set-ups: record what a path's patches may touch, put all of it back afterwards.

Axolotl's and Liger's patches replace classes and functions in transformers' modeling modules,
entries of transformers' attention / mask / experts registries, methods of peft and transformers
classes, and per-instance attributes (LoRA kernels bind `forward` / `apply_qkv` / ... on each
module). `Undo` snapshots each of those before a path installs anything and restores them, in
reverse order, when the path ends, so the next path runs on exactly the model it would have had.
"""

from __future__ import annotations

import types

_MISSING = object()

# per-instance attributes that Axolotl's LoRA kernels and ScatterMoE bind on modules
INSTANCE_KEYS = (
    "forward", "apply_qkv", "apply_o", "apply_in_proj_fused", "apply_out_proj",
    "_scattermoe_lora", "_scattermoe_iface_ok",
)


def snapshot_module(module: types.ModuleType) -> dict:
    """A module's globals and the attributes of the classes it defines."""
    classes = {
        obj: dict(vars(obj))
        for obj in vars(module).values()
        if isinstance(obj, type) and obj.__module__ == module.__name__
    }
    return {"globals": dict(vars(module)), "classes": classes}


def changed_in_module(module: types.ModuleType, saved: dict) -> list[str]:
    """Names of globals and `Class.attr`s that differ from the snapshot."""
    out = [k for k, v in vars(module).items() if saved["globals"].get(k, _MISSING) is not v and not k.startswith("__")]
    for cls, attrs in saved["classes"].items():
        out += [f"{cls.__name__}.{k}" for k, v in vars(cls).items() if attrs.get(k, _MISSING) is not v]
    return out


def restore_module(module: types.ModuleType, saved: dict) -> None:
    for cls, attrs in saved["classes"].items():
        for key in [k for k in vars(cls) if k not in attrs]:
            delattr(cls, key)
        for key, value in attrs.items():
            if key in ("__dict__", "__weakref__"):
                continue
            if vars(cls).get(key, _MISSING) is not value:
                setattr(cls, key, value)
    namespace = vars(module)
    for key in [k for k in namespace if k not in saved["globals"]]:
        del namespace[key]
    for key, value in saved["globals"].items():
        if namespace.get(key, _MISSING) is not value:
            namespace[key] = value


class Undo:
    """Snapshots taken before a set-up, restored in reverse order by `restore()`."""

    def __init__(self):
        self._steps: list = []
        self._modules: set[str] = set()

    def module(self, module: types.ModuleType) -> dict:
        """Snapshot a module (once per Undo); returns the snapshot."""
        saved = snapshot_module(module)
        if module.__name__ not in self._modules:
            self._modules.add(module.__name__)
            self._steps.append(lambda: restore_module(module, saved))
        return saved

    def attr(self, obj, name: str) -> None:
        """Snapshot `obj.name` as it is in `vars(obj)` (absent, or the value itself)."""
        value = vars(obj).get(name, _MISSING)

        def undo():
            if value is _MISSING:
                if name in vars(obj):
                    delattr(obj, name)
            elif vars(obj).get(name, _MISSING) is not value:
                setattr(obj, name, value)

        self._steps.append(undo)

    def mapping(self, mapping: dict) -> None:
        """Snapshot a dict's entries (restored in place: the same dict object)."""
        saved = dict(mapping)

        def undo():
            mapping.clear()
            mapping.update(saved)

        self._steps.append(undo)

    def interface(self, interface) -> None:
        """A transformers `GeneralInterface` (attention, mask, experts registries): both maps."""
        self.mapping(type(interface)._global_mapping)
        self.mapping(interface._local_mapping)

    def instances(self, root) -> None:
        """Per-instance attributes in INSTANCE_KEYS of every submodule of `root`."""
        saved = [(m, {k: vars(m).get(k, _MISSING) for k in INSTANCE_KEYS}) for m in root.modules()]

        def undo():
            for m, attrs in saved:
                for key, value in attrs.items():
                    if value is _MISSING:
                        vars(m).pop(key, None)
                    else:
                        setattr(m, key, value)

        self._steps.append(undo)

    def swap(self, parent, name: str, old, new) -> None:
        """Replace child `name` of `parent` by `new` now; put `old` back on restore."""
        parent._modules[name] = new
        self._steps.append(lambda: parent._modules.__setitem__(name, old))

    def call(self, fn) -> None:
        """Run `fn()` on restore (for state that only its owner can reset)."""
        self._steps.append(fn)

    def restore(self) -> None:
        errors = []
        while self._steps:
            step = self._steps.pop()
            try:
                step()
            except Exception as exc:  # keep restoring the rest; report at the end
                errors.append(f"{type(exc).__name__}: {exc}")
        self._modules.clear()
        if errors:
            raise RuntimeError(f"restoring the path's set-up failed: {'; '.join(errors)}")


def fingerprint(model, modules: list[types.ModuleType]) -> dict:
    """What a path may change, for tests: every submodule's type and per-instance attributes, and
    the globals and class attributes of `modules` (compare two fingerprints with ==)."""
    per_module = [
        (name, type(m), tuple((k, id(vars(m)[k])) for k in INSTANCE_KEYS if k in vars(m)))
        for name, m in model.named_modules()
    ]
    per_param = [(name, id(p)) for name, p in model.named_parameters()]
    mods = {}
    for module in modules:
        saved = snapshot_module(module)
        mods[module.__name__] = (
            {k: id(v) for k, v in saved["globals"].items() if not k.startswith("__")},
            {cls.__name__: {k: id(v) for k, v in attrs.items()} for cls, attrs in saved["classes"].items()},
        )
    return {"modules": per_module, "parameters": per_param, "python_modules": mods}
