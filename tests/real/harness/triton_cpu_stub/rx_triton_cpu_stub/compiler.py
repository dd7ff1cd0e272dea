"""The backend's compiler: never used under TRITON_INTERPRET=1; anything else is refused."""

from triton.backends.compiler import BaseBackend, GPUTarget

REFUSE = "the rx-triton-cpu-stub backend compiles nothing: run with TRITON_INTERPRET=1"


class InterpreterOnlyBackend(BaseBackend):
    @staticmethod
    def supports_target(target: GPUTarget) -> bool:
        return target.backend == "cpu"

    def __init__(self, target: GPUTarget) -> None:
        super().__init__(target)

    def hash(self) -> str:
        return "rx-triton-cpu-stub"

    def parse_options(self, options: dict) -> object:
        raise RuntimeError(REFUSE)

    def add_stages(self, stages: dict, options: object, *args: object) -> None:
        raise RuntimeError(REFUSE)

    def load_dialects(self, context: object) -> None:
        return None

    def get_module_map(self) -> dict:
        return {}
