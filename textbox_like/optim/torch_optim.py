"""The other optimizers of torch.optim, by their lower-case class names
(ESPnet2's spellings: adagrad, adamax, asgd, rmsprop, ...; any case works).

They have no options of their own: their constructor arguments are
``--optim_conf`` keys (``--optim rmsprop --optim_conf alpha=0.9``), checked
against the class's signature and listed in full by ``--print_config``;
``--lr``, ``--weight-decay`` and ``--epsilon`` feed lr, weight_decay and eps.
"""
from textbox_like.optim import TORCH_OPTIMIZERS, OPTIMIZERS, OptimizerSpec

#: optimizers whose step this trainer cannot drive, and why
UNUSABLE = {
    "LBFGS": "L-BFGS re-evaluates the loss through a closure at every step, which this trainer does not pass",
    "SparseAdam": "SparseAdam takes only sparse gradients (nn.Embedding(sparse=True)); the models here have "
                  "dense ones",
    "Muon": "Muon takes only 2-D weight matrices; the models here also have biases and norms",
}


def _register(class_name):
    name = class_name.lower()
    if name in OPTIMIZERS.names():
        return
    spec = type(f"Torch{class_name}", (OptimizerSpec,), {
        "torch_name": class_name, "unusable": UNUSABLE.get(class_name),
        "__doc__": f"torch.optim.{class_name}"})
    OPTIMIZERS.register(name)(spec)


for _class_name in TORCH_OPTIMIZERS:
    _register(_class_name)
