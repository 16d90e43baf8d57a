"""Demo models that ship with the package, as Lightning ships ``lightning.pytorch.demos``: the
example GPT (``demos.gpt``), a Llama-style model (``demos.llama``) and the data modules they train on
(generated, nothing is downloaded). The shipped configs name them, so they run from any directory
after a plain ``pip install``."""
