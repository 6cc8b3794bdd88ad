"""The optional packages a training setup needs, checked before they are imported.

memplan imports torch, transformers and peft at its core; the techniques below bring their
own package, imported only when a setup asks for the technique, so that memplan imports and
estimates everything else on a machine without them (a GPU machine's own Python, say):

- bitsandbytes: a quantised base (`quant` nf4 / fp4 / int8, `memplan.models.build`) and its
  optimizers (`memplan.models.optimizers.BNB_OPTIMIZERS`);
- torchao: its low-bit AdamW (`AO_OPTIMIZERS`) and `CPUOffloadOptimizer` (`cpu_offload`
  optimizer);
- litgpt: LitGPT's own model (`impl` litgpt), whose import `memplan.models.litgpt` guards itself.

Each builder calls `require` for what it is about to import. A missing package is then a
`UserError` naming the flag and the install command, where the build would otherwise fail
deep inside another package (transformers' bitsandbytes integration, for one, raises a
`NameError`: it names `bnb`, which it imports only when bitsandbytes is installed). The
pinned versions are in requirements.lock.
"""

from __future__ import annotations

import importlib.util

from memplan.errors import UserError

INSTALL = {
    "bitsandbytes": "pip install bitsandbytes (the version requirements.lock pins)",
    "torchao": "pip install torchao (the version requirements.lock pins)",
}


def require(package: str, flag: str) -> None:
    """`UserError` when `package`, which `flag` needs, is not installed in this Python."""
    if importlib.util.find_spec(package) is None:
        raise UserError(f"{flag} needs {package}, which is not installed in this Python: {INSTALL[package]}")
