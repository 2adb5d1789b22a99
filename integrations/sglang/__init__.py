"""SGLang adapter: ``--linear-attn-backend flashqla`` runs SGLang's GDN layers on qla-serving.

Installed as ``qla_serving.integrations.sglang``. SGLang finds it through the
``sglang.srt.plugins`` entry point ``qla_serving = qla_serving.integrations.sglang:register``,
which SGLang's ``load_plugins()`` calls early in every process (launcher, scheduler,
detokenizer), before the server arguments are parsed.

Seams used (present from SGLang 0.5.17 to 0.5.23, see ``docs/sglang.md``):

* ``add_linear_attn_kernel_backend_choices`` — makes ``flashqla`` a valid value of
  ``--linear-attn-backend`` / ``--linear-attn-prefill-backend`` / ``--linear-attn-decode-backend``;
* ``LinearAttnKernelBackend("flashqla")`` maps to ``CUSTOM``;
* ``LinearAttnKernelBase`` — :class:`~.kernel.FlashQLAGDNKernel` implements
  ``decode`` / ``extend`` / ``target_verify``;
* SGLang's own ``HookRegistry`` (the plugin framework's patch mechanism) — the only patch:
  ``GDNKernelDispatcher`` raises on ``CUSTOM``, so its ``__init__`` is wrapped to hand the
  phases that asked for ``flashqla`` our kernel. All hooks live in :mod:`.patch`, which
  checks the installed SGLang before installing them.
"""

from __future__ import annotations

from ...constants import BACKEND_NAME

__all__ = ["BACKEND_NAME", "register"]


def register() -> None:
    """The ``sglang.srt.plugins`` entry point: check SGLang, add the backend name, install hooks.

    Idempotent. Raises :class:`~.patch.IncompatibleSGLang` (SGLang's loader logs it and goes
    on without the backend, so ``flashqla`` is then rejected as an invalid choice).
    """
    from .patch import install

    install()
