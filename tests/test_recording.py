"""The recorder behind straight-line reproducers (adapters/recording.py): what the scheduler
machine's files need of it -- a value the file makes itself written by name, a plan asserted,
a construction with positional arguments, a msgspec-style struct written by keyword.  No vLLM."""

from __future__ import annotations

from kvspec.adapters.recording import Recorder


class Struct:
    """Shaped like a msgspec Struct: ``__struct_fields__``, defaults for the last fields."""

    __struct_fields__ = ("name", "number", "path", "flag")
    __struct_defaults__ = ("", False)
    __module__ = "vllm.lora.request"
    __qualname__ = "Struct"

    def __init__(self, name: str, number: int, path: str = "", flag: bool = False) -> None:
        self.name, self.number, self.path, self.flag = name, number, path, flag


def made(*args: object, **kwargs: object) -> tuple:
    return args, kwargs


def test_a_struct_is_written_by_keyword_without_its_defaults():
    rec = Recorder()
    assert rec.render(Struct("a", 1, path="/p")) == "Struct(name='a', number=1, path='/p')"
    assert rec.render(Struct("a", 1)) == "Struct(name='a', number=1)"
    assert rec.imports["vllm.lora.request"] == {"Struct"}


def test_an_aliased_value_is_written_by_its_name():
    rec = Recorder()
    folder = "/tmp/some-model-folder"
    rec.alias(folder, "model_dir")
    assert rec.render({"model": folder, "other": "/tmp/x"}) == "{'model': model_dir, 'other': '/tmp/x'}"


def test_a_construction_keeps_its_positional_arguments_and_a_plan_is_asserted():
    rec = Recorder()
    proxy = rec.construct(made, {"k": 2}, "hasher", (1, "x"))
    assert rec.lines[-1].code == "hasher0 = made(1, 'x', k=2)"
    assert proxy._real == ((1, "x"), {"k": 2})
    rec.op_index = 3
    rec.expect("r0", "num_scheduled_tokens", {"seq0": 4})
    assert rec.lines[-1].code == "assert r0.num_scheduled_tokens == {'seq0': 4}"
    assert rec.lines[-1].op_index == 3
