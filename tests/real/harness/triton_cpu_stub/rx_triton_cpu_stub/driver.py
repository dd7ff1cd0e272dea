"""The backend's driver: active (the machine has a CPU), with the CPU as its torch device."""

from triton.backends.compiler import GPUTarget
from triton.backends.driver import DriverBase


class InterpreterOnlyDriver(DriverBase):
    @classmethod
    def is_active(cls) -> bool:
        return True

    def map_python_to_cpp_type(self, ty: str) -> str:
        raise RuntimeError("the rx-triton-cpu-stub backend compiles nothing")

    def get_current_target(self) -> GPUTarget:
        return GPUTarget("cpu", 0, 0)

    def get_active_torch_device(self):  # noqa: ANN201 (torch is the engine's, not ours)
        import torch

        return torch.device("cpu")

    def get_benchmarker(self):  # noqa: ANN201
        from triton.testing import do_bench

        return do_bench

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: object = None) -> int:
        return 0
