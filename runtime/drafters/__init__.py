"""Drafters: one interface (`base.Drafter`), what it proposes (`tree.DraftTree`), the n-gram
drafter, and the block drafters' torch and ggml backends. May import `llama/`, `format/`,
`errors`, and the torch models (`blockspec.models`) and converters the backends run."""
