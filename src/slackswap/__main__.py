"""``python -m slackswap``: the same as the ``slackswap`` command."""

from slackswap.cli import main

main()
