"""`python -m hixl.client.as_mooncake COMMAND ...`: the hixl-as-mooncake launcher."""

import sys

from hixl.client.as_mooncake import main

sys.exit(main())
