"""Import shims that let vLLM's in-tree model code load in the plugin's environment.

Nothing here is registered on import: call the functions from the plugin's model
registration, before vLLM imports the model modules they are about.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types

# vLLM 0.33: llava.py -> pixtral.py -> this module -> torchvision.
TORCHVISION_PIXTRAL_MODULE = "transformers.models.pixtral.image_processing_pixtral"
# Its PIL twin in transformers 5: same ``_num_image_tokens`` and
# ``get_resize_output_image_size`` (the two names vLLM and transformers' own
# ``processing_pixtral`` import from the module above), no torchvision.
PIL_PIXTRAL_MODULE = "transformers.models.pixtral.image_processing_pil_pixtral"


def _torchvision_pixtral_importable() -> bool:
    """Whether the torchvision-based pixtral image processor imports here.

    False without torchvision, and also when a torchvision is installed that does not
    load beside this torch (the registry's CUDA build next to a CPU torch raises
    ``RuntimeError`` or ``OSError`` rather than ``ImportError``).
    """
    if importlib.util.find_spec("torchvision") is None:
        return False
    try:
        importlib.import_module(TORCHVISION_PIXTRAL_MODULE)
    except Exception:  # any failure means "use the PIL twin"
        sys.modules.pop(TORCHVISION_PIXTRAL_MODULE, None)
        return False
    return True


def use_pil_pixtral_image_processor() -> None:
    """Make ``import vllm.model_executor.models.llava`` work without torchvision.

    Why: vLLM 0.33's ``llava.py`` imports its Pixtral code, whose module top does
    ``from transformers.models.pixtral.image_processing_pixtral import
    _num_image_tokens``; in transformers 5 that module is the torchvision backend
    and imports ``torchvision`` at its top (so does ``PixtralProcessor``, which
    llava.py also imports). Every LLaVA-family model in vLLM therefore needs
    torchvision just to be imported, although LLaVA with a CLIP tower never calls
    the Pixtral image processor. This points ``sys.modules`` entry
    ``transformers.models.pixtral.image_processing_pixtral`` at the PIL twin
    ``transformers.models.pixtral.image_processing_pil_pixtral``, whose helper
    functions are identical. Only ``PixtralImageProcessor`` (the torchvision class)
    is then missing from the aliased module; the PIL class is
    ``PixtralImageProcessorPil``.

    When: call it before vLLM imports ``vllm.model_executor.models.llava`` (or
    ``pixtral``), i.e. from the plugin's model registration in every process. It
    does nothing when torchvision works (the real module is then used), when the
    real module is already imported, or when it was already called (idempotent).

    When it can go: once torchvision is part of the environment (e.g. a matching
    torch + torchvision pair), or once vLLM stops importing the torchvision-backed
    module (or transformers stops importing torchvision there at module level).
    """
    if TORCHVISION_PIXTRAL_MODULE in sys.modules:
        return  # already aliased, or the real one is already loaded
    if _torchvision_pixtral_importable():
        return
    pil_module = importlib.import_module(PIL_PIXTRAL_MODULE)
    sys.modules[TORCHVISION_PIXTRAL_MODULE] = pil_module


# vLLM 0.33: qwen2_vl.py (and qwen2_5_vl.py, qwen3_vl.py through it) do
# ``from transformers.models.qwen2_vl import Qwen2VLImageProcessor`` and
# ``from ...image_processing_qwen2_vl import smart_resize``; in transformers 5
# that module is the torchvision backend.
TORCHVISION_QWEN2_VL_MODULE = "transformers.models.qwen2_vl.image_processing_qwen2_vl"
PIL_QWEN2_VL_MODULE = "transformers.models.qwen2_vl.image_processing_pil_qwen2_vl"


def torchvision_works() -> bool:
    """Whether ``torchvision`` is installed and imports beside this torch."""
    if importlib.util.find_spec("torchvision") is None:
        return False
    try:
        importlib.import_module("torchvision.transforms.v2.functional")
    except Exception:  # a CUDA build beside a CPU torch raises RuntimeError/OSError
        return False
    return True


# vLLM 0.33: gemma3_mm.py imports ``Gemma3ImageProcessor`` from this module (for a
# type annotation only); in transformers 5 it is the torchvision backend.
TORCHVISION_GEMMA3_MODULE = "transformers.models.gemma3.image_processing_gemma3"
PIL_GEMMA3_MODULE = "transformers.models.gemma3.image_processing_pil_gemma3"


def _importable(module: str) -> bool:
    """Whether ``module`` imports here (any failure, torchvision's ``RuntimeError``
    or ``OSError`` beside a mismatched torch included, means no)."""
    if importlib.util.find_spec("torchvision") is None:
        return False
    try:
        importlib.import_module(module)
    except Exception:
        sys.modules.pop(module, None)
        return False
    return True


def use_pil_qwen2_vl_image_processor() -> None:
    """Make ``import vllm.model_executor.models.qwen2_5_vl`` work without torchvision.

    Why: the torchvision-backed module named above is imported at the top of vLLM's
    Qwen2-VL code for a type annotation (``Qwen2VLImageProcessor``) and the pure
    function ``smart_resize``. Its PIL twin has the same ``smart_resize`` (same
    arithmetic, numpy only) and the same processing as ``Qwen2VLImageProcessorPil``.
    This puts a module in ``sys.modules`` under the torchvision module's name
    holding every name of the PIL twin plus ``Qwen2VLImageProcessor`` bound to
    the PIL class, so both imports (and transformers' lazy
    ``transformers.models.qwen2_vl.Qwen2VLImageProcessor``) resolve to PIL code.

    When: from the plugin's model registration, before vLLM imports its Qwen
    models. Does nothing when torchvision works, when the real module is already
    imported, or when already called (idempotent).

    When it can go: once torchvision is part of the environment, or once vLLM
    imports the image processor lazily.
    """
    if TORCHVISION_QWEN2_VL_MODULE in sys.modules or torchvision_works():
        return
    pil = importlib.import_module(PIL_QWEN2_VL_MODULE)
    alias = types.ModuleType(TORCHVISION_QWEN2_VL_MODULE, pil.__doc__)
    alias.__dict__.update(
        {k: v for k, v in vars(pil).items() if not k.startswith("__")}
    )
    alias.Qwen2VLImageProcessor = pil.Qwen2VLImageProcessorPil  # type: ignore[attr-defined]
    sys.modules[TORCHVISION_QWEN2_VL_MODULE] = alias


def use_pil_gemma3_image_processor() -> None:
    """Make ``import vllm.model_executor.models.gemma3_mm`` work without torchvision.

    Why: vLLM 0.33's ``gemma3_mm.py`` does ``from
    transformers.models.gemma3.image_processing_gemma3 import
    Gemma3ImageProcessor`` at its top, and that module imports torchvision in
    transformers 5. vLLM only reads the processor's pan-and-scan settings through
    it (the same attributes on the PIL twin, ``Gemma3ImageProcessorPil``, which
    transformers itself picks when torchvision is missing). This registers, under
    the torchvision module's name, a module holding the PIL twin's names with
    ``Gemma3ImageProcessor`` bound to ``Gemma3ImageProcessorPil``; the PIL module
    itself is left as it is.

    When: from the plugin's model registration, before vLLM imports
    ``gemma3_mm``. It does nothing when torchvision works, when the real module
    is already imported, or when it was already called (idempotent).

    When it can go: as for ``use_pil_pixtral_image_processor``.
    """
    if TORCHVISION_GEMMA3_MODULE in sys.modules:
        return
    if _importable(TORCHVISION_GEMMA3_MODULE):
        return
    pil_module = importlib.import_module(PIL_GEMMA3_MODULE)
    shim = types.ModuleType(
        TORCHVISION_GEMMA3_MODULE,
        f"vllm-hpu-mm: {PIL_GEMMA3_MODULE} under the torchvision module's name",
    )
    shim.__dict__.update(
        {k: v for k, v in vars(pil_module).items() if not k.startswith("__")}
    )
    shim.Gemma3ImageProcessor = pil_module.Gemma3ImageProcessorPil  # type: ignore[attr-defined]
    sys.modules[TORCHVISION_GEMMA3_MODULE] = shim


# vLLM 0.33: qwen3_vl.py does ``from transformers.models.qwen3_vl import
# Qwen3VLVideoProcessor`` and counts video tokens only for processors that are
# ``isinstance`` of it; without torchvision transformers' lazy module hands out
# a placeholder class that nothing is an instance of.
QWEN3_VL_PACKAGE = "transformers.models.qwen3_vl"


def use_torchvision_free_qwen3_video_processor() -> None:
    """Bind ``Qwen3VLVideoProcessor`` in ``transformers.models.qwen3_vl`` (and in
    vLLM's ``qwen3_vl`` if already imported) to the plugin's torchvision-free
    class (``models.qwen_video.Qwen3VLVideoProcessorNoTV``).

    Why: vLLM's Qwen3-VL processing info picks the video ``smart_resize`` (and
    the video token count) by ``isinstance(processor, Qwen3VLVideoProcessor)``;
    with the placeholder every video would be counted as an image.

    When: from the plugin's model registration, before vLLM imports its Qwen3-VL
    module. Does nothing when torchvision works (idempotent).

    When it can go: as for ``use_pil_qwen2_vl_image_processor``.
    """
    if torchvision_works():
        return
    from vllm_hpu_mm.models.qwen_video import Qwen3VLVideoProcessorNoTV

    package = importlib.import_module(QWEN3_VL_PACKAGE)
    package.Qwen3VLVideoProcessor = Qwen3VLVideoProcessorNoTV  # type: ignore[attr-defined]
    vllm_module = sys.modules.get("vllm.model_executor.models.qwen3_vl")
    if vllm_module is not None:
        vllm_module.Qwen3VLVideoProcessor = Qwen3VLVideoProcessorNoTV  # type: ignore[attr-defined]
