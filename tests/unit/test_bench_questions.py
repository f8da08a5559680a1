"""The new-question workload (bench.questions, bench.workload.Requests): every send in a process asks
a question not asked before, on its agent's topics, and the rest of the request is the template's."""

from __future__ import annotations

from bench.questions import PER_AGENT, TOPICS, FreshQuestions, question
from bench.workload import Requests, request_templates


def test_every_question_of_an_agent_pool_is_distinct_and_a_lap_stays_new() -> None:
    pool = [question("devops-helper", k) for k in range(PER_AGENT)]
    assert len(set(pool)) == PER_AGENT
    beyond = {question("devops-helper", k) for k in range(PER_AGENT, PER_AGENT + 500)}
    assert not beyond & set(pool) and len(beyond) == 500


def test_questions_are_on_the_agents_topics() -> None:
    for agent, topics in TOPICS.items():
        for k in range(50):
            assert any(t in question(agent, k) for t in topics)


def test_fresh_questions_never_repeat_across_agents_and_starts() -> None:
    fresh = FreshQuestions()
    seen = [fresh(agent) for _ in range(2000) for agent in TOPICS]
    assert len(set(seen)) == len(seen)
    near_end = FreshQuestions(start=PER_AGENT - 3)
    wrapped = [near_end("hr-helper") for _ in range(10)]
    assert len(set(wrapped)) == 10


def test_requests_new_questions_replace_query_and_newest_user_turn_only() -> None:
    templates = request_templates(n=12)
    fresh = Requests(templates, new_questions=True)
    sent = [fresh.nth(i) for i in range(120)]
    assert len({r.query for r in sent}) == 120
    for i, req in enumerate(sent):
        tmpl = templates[i % len(templates)]
        assert req.query not in {t.query for t in templates}
        assert req.recent_messages[-1].role == "user" and req.recent_messages[-1].content == req.query
        assert req.recent_messages[:-1] == tmpl.recent_messages[:-1]
        assert (req.org_id, req.agent_id, req.model) == (tmpl.org_id, tmpl.agent_id, tmpl.model)
    repeated = Requests(templates)
    assert [repeated.nth(i) for i in range(24)] == [*templates, *templates]
