"""The command-line side: ``flashqla`` as a ``--gdn-prefill-backend`` choice, and ``--linear-attn-backend``.

vLLM keeps the GDN backend choice in ``EngineArgs.gdn_prefill_backend``, which
``create_engine_config`` copies into ``VllmConfig.additional_config["gdn_prefill_backend"]``;
every process (API server, engine core, workers) reads it from there. Both flags therefore
write that one destination, and ``LLM(..., gdn_prefill_backend="flashqla")`` or
``--additional-config '{"gdn_prefill_backend": "flashqla"}'`` work without the parser.

vLLM builds ``--gdn-prefill-backend``'s choices inside ``EngineArgs.add_cli_args`` and offers
no hook to extend them, so this module wraps that one static method: the only patch the
plugin makes. It is applied once, checked against the installed vLLM by
:mod:`.compat`, and fails loudly if the flag it extends is not where it expects.
"""

from __future__ import annotations

import argparse
import functools

from ...constants import BACKEND_NAME

# The values --linear-attn-backend accepts besides ours: vLLM's own GDN prefill backends are
# read from the parser at wrap time, so the alias always offers what vLLM offers.
CONFIG_KEY = "gdn_prefill_backend"
LINEAR_ATTN_FLAG = "--linear-attn-backend"
GDN_FLAG = "--gdn-prefill-backend"

_WRAPPED_MARK = "_qla_serving_wrapped"


def requested_backend(vllm_config) -> str:
    """The GDN prefill backend the user asked for (``"auto"`` when none), lower-cased.

    Args:
        vllm_config: a ``vllm.config.VllmConfig`` (anything with ``additional_config``).
    """
    extra = getattr(vllm_config, "additional_config", None)
    value = extra.get(CONFIG_KEY, "auto") if isinstance(extra, dict) else "auto"
    return str(value).strip().lower()


def flashqla_requested(vllm_config) -> bool:
    return requested_backend(vllm_config) == BACKEND_NAME


def _find_action(parser: argparse.ArgumentParser, option: str) -> argparse.Action | None:
    for action in parser._actions:  # argparse keeps no public index of its actions
        if option in action.option_strings:
            return action
    return None


def extend_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add ``flashqla`` to ``--gdn-prefill-backend`` and add ``--linear-attn-backend`` (idempotent).

    Args:
        parser: a parser on which vLLM's ``EngineArgs.add_cli_args`` has already run.

    Raises:
        RuntimeError: the parser has no ``--gdn-prefill-backend`` (vLLM moved the flag).
    """
    gdn = _find_action(parser, GDN_FLAG)
    if gdn is None:
        raise RuntimeError(
            f"qla-serving: vLLM's parser has no {GDN_FLAG} flag to extend; this vLLM is not supported "
            "by the plugin (see docs/vllm.md for the supported versions)"
        )
    choices = list(gdn.choices or [])
    if BACKEND_NAME not in choices:
        choices.append(BACKEND_NAME)
        gdn.choices = choices
        gdn.help = (gdn.help or "") + f" '{BACKEND_NAME}' runs the qla-serving TileLang kernels."
    if _find_action(parser, LINEAR_ATTN_FLAG) is None:
        parser.add_argument(
            LINEAR_ATTN_FLAG,
            dest=gdn.dest,  # one destination: whichever flag comes last wins, as for a repeated flag
            choices=list(choices),
            default=None,
            help=(
                f"Backend of the linear-attention (Gated DeltaNet) layers; an alias of {GDN_FLAG} "
                f"added by qla-serving. '{BACKEND_NAME}' runs prefill and decode on its TileLang "
                "kernels and falls back to vLLM's default, with one warning, where they cannot run "
                "(QLA_STRICT=1 makes that an error)."
            ),
        )
    return parser


def install_cli_args() -> None:
    """Wrap ``EngineArgs.add_cli_args`` so every parser vLLM builds gets :func:`extend_parser`."""
    from vllm.engine.arg_utils import EngineArgs

    original = EngineArgs.__dict__["add_cli_args"]
    original_fn = original.__func__ if isinstance(original, staticmethod) else original
    if getattr(original_fn, _WRAPPED_MARK, False):
        return

    @functools.wraps(original_fn)
    def add_cli_args(parser, *args, **kwargs):
        return extend_parser(original_fn(parser, *args, **kwargs))

    setattr(add_cli_args, _WRAPPED_MARK, True)
    EngineArgs.add_cli_args = staticmethod(add_cli_args)
