"""SlackSwap in training frameworks, through each one's own extension point: ``hf`` (a
Hugging Face ``Trainer`` callback) and ``lightning`` (a Lightning callback). Each module
imports its framework when it is imported, never before; all of them rest on
:func:`slackswap.attach`."""
