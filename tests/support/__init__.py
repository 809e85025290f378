"""What tests and benches share that is not a test: the fixtures' paths (`paths`), loopback servers
(OpenAI-compatible, Hub, AgentGym), the tiny model, seeded corpora and agents, and the test oracles
(`oracles`: second, plainer implementations of production steps that the tests hold the production
code to)."""
