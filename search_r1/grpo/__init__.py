"""The simple single-process API: a config, a search engine, a trainer, `train_step(queries, answers)`.

    from search_r1.grpo import GRPOTrainer, MockSearchEngine, SearchR1Config, create_training_data
    queries, answers = create_training_data(8)
    trainer = GRPOTrainer(SearchR1Config(max_tokens=128), search_engine=MockSearchEngine({...}))
    print(trainer.train_step(queries[:2], answers[:2])["avg_reward"])

Everything is re-exported from where it lives (records, config and trainer here; search engines from
`search_r1.search`; reward functions from `search_r1.rewards`), not copied.
"""
from search_r1.grpo.config import SearchR1Config
from search_r1.grpo.data import create_training_data, load_training_data, synthetic_knowledge_base
from search_r1.grpo.openai_chat import OpenAIChatGenerator, resolve_openai_api
from search_r1.grpo.records import TokenStep, Trajectory
from search_r1.grpo.trainer import (GRPOTrainer, PolicyUpdateUnavailable, build_search_engine, config_reward,
                                    final_answer_of)
from search_r1.rewards import check_answer_correctness, check_format_correctness, compute_reward
from search_r1.search import MockSearchEngine, RetrieverClient, SearchEngine, SearchError, WebSearchEngine

# The name for our HTTP retriever client.
RetrieverSearchEngine = RetrieverClient

__all__ = [
    "GRPOTrainer", "SearchR1Config", "TokenStep", "Trajectory", "PolicyUpdateUnavailable",
    "SearchEngine", "SearchError", "MockSearchEngine", "RetrieverSearchEngine", "RetrieverClient", "WebSearchEngine",
    "check_format_correctness", "check_answer_correctness", "compute_reward",
    "create_training_data", "load_training_data", "synthetic_knowledge_base", "build_search_engine",
    "final_answer_of", "config_reward", "OpenAIChatGenerator", "resolve_openai_api",
]
