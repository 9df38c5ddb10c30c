"""The PORTool tool world: an offline, seeded world, its 17 tools, queries and verifier.

`ToolWorldFamily` is the task family (see `family.py`); `World.build(seed)` the
world; `make_tools(world, context)` the tools bound to one task's present.
"""

from tree_rl.envs.toolworld.family import ToolWorldFamily
from tree_rl.envs.toolworld.timeutil import Context
from tree_rl.envs.toolworld.tools import TOOL_NAMES, make_tools
from tree_rl.envs.toolworld.world import World

__all__ = ["TOOL_NAMES", "Context", "ToolWorldFamily", "World", "make_tools"]
