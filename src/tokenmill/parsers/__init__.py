"""Model-output parsers shared by the engine and the servers: reasoning blocks
(`parsers.reasoning`) and tool calls (`parsers.tools`). Nothing here imports
`tokenmill.entrypoints`."""
