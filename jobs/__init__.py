"""Stage implementations: `jobs.<stage>.run(ctx) -> metrics`. These import torch."""
