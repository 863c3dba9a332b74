"""The consoles the ``xdplb`` commands print on, and the one way a message carrying data
is printed: rich markup is off on both consoles, so text in square brackets (a VIP
``[fd78:6470:6c62:100::1]:80/tcp``, a YAML error's ``expected ',' or ']'``) prints as
it is; colour goes only on a message's fixed words, through :func:`markup`; and nothing
is wrapped (soft wrap), so a long error stays one line in a log or a pipe.
"""

from __future__ import annotations

from rich.console import Console
from rich.markup import escape
from rich.text import Text

#: stdout and stderr: no markup, no emoji codes (":100:" in an IPv6 address), no
#: highlighting, no wrapping.
console = Console(markup=False, highlight=False, soft_wrap=True, emoji=False)
err = Console(stderr=True, markup=False, highlight=False, soft_wrap=True, emoji=False)


def markup(template: str, *values: object) -> Text:
    """``template``'s rich markup for its fixed words, each ``{}`` filled with the next
    of ``values`` as plain text: whatever a value holds is never read as markup.
    ``markup("[red]invalid[/red] {}: {}", path, error)``."""
    return Text.from_markup(template.format(*(escape(str(v)) for v in values)), emoji=False)


def fail(label: str, message: object) -> None:
    """``label message`` on stderr, the fixed ``label`` in red, ``message`` as it is."""
    err.print(markup("[red]{}[/red] {}", label, message))
