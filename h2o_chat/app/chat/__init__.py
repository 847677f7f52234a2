"""The interactive chat: the conversation and its cache, slash commands, the view, resuming a saved one."""
