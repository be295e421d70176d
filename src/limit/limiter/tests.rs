//! The orchestration over a fake store that answers as it is told:
//! decides, fails as in an outage, refuses floodgate's settings, answers
//! late, recovers. Each test pins what was decided, never how long it took.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::{Answer, Guarded};
use crate::client::ClientId;
use crate::limit::backend::{Part, StoreNode};
use crate::limit::breaker::{Breaker, DEFAULT_THRESHOLD};
use crate::limit::deny_cache::GivenBack;
use crate::limit::settings::OnError;
use crate::limit::{Algorithm, Backend, Charge, Decision, Kept, Limit, Settlement, StoreError};
use crate::metrics::Metrics;

/// The fake store's deadline.
const TIMEOUT: Duration = Duration::from_millis(100);
/// A cooldown no test waits out: an open breaker stays open.
const LONG: u64 = 3_600_000;

/// What the fake store answers.
#[derive(Debug, Clone)]
enum Told {
    Decide(Decision),
    /// Cannot be reached.
    Outage,
    /// Answers, and refuses floodgate's password.
    Refuse,
    /// Allows after this long, if that is within its deadline.
    Late(Duration),
}

#[derive(Debug)]
struct FakeNode {
    breaker: Breaker,
}

impl StoreNode for FakeNode {
    fn addr(&self) -> &str {
        "fake:6379"
    }

    fn breaker(&self) -> &Breaker {
        &self.breaker
    }
}

/// One node; counts how often it was asked.
#[derive(Debug)]
struct Fake {
    node: Arc<FakeNode>,
    told: Mutex<Told>,
    asked: AtomicUsize,
    given_back: GivenBack,
}

impl Fake {
    fn new(cooldown_ms: u64, told: Told) -> Self {
        let given_back = GivenBack::default();
        given_back.listening();
        Self {
            node: Arc::new(FakeNode {
                breaker: Breaker::new(DEFAULT_THRESHOLD, cooldown_ms),
            }),
            told: Mutex::new(told),
            asked: AtomicUsize::new(0),
            given_back,
        }
    }

    fn tell(&self, told: Told) {
        *self.told.lock().unwrap() = told;
    }

    fn asked(&self) -> usize {
        self.asked.load(Ordering::SeqCst)
    }

    async fn answer(&self) -> Result<Decision, StoreError> {
        self.asked.fetch_add(1, Ordering::SeqCst);
        let told = self.told.lock().unwrap().clone();
        match told {
            Told::Decide(decision) => Ok(decision),
            Told::Outage => Err(StoreError::Backend("connection refused".to_owned())),
            Told::Refuse => Err(StoreError::Refused(
                "WRONGPASS: set the password".to_owned(),
            )),
            Told::Late(by) => {
                tokio::time::timeout(TIMEOUT, tokio::time::sleep(by))
                    .await
                    .map_err(|_| StoreError::Timeout(TIMEOUT))?;
                Ok(allowed())
            }
        }
    }
}

impl Backend for Fake {
    type Node = FakeNode;
    type Target = Arc<FakeNode>;

    fn nodes(&self) -> Vec<Arc<FakeNode>> {
        vec![Arc::clone(&self.node)]
    }

    fn node_of(target: &Arc<FakeNode>) -> &Arc<FakeNode> {
        target
    }

    fn is_cluster(&self) -> bool {
        false
    }

    fn refresh_nodes(&self) {}

    fn target(&self, _: &Charge<'_>) -> Result<Arc<FakeNode>, StoreError> {
        Ok(Arc::clone(&self.node))
    }

    fn parts(&self, _: &Charge<'_>) -> Option<Vec<Part<Arc<FakeNode>>>> {
        None
    }

    async fn decide_on(&self, _: Arc<FakeNode>, _: Charge<'_>) -> Result<Decision, StoreError> {
        self.answer().await
    }

    async fn peek_on(
        &self,
        _: Arc<FakeNode>,
        _: Charge<'_>,
    ) -> Result<Vec<crate::limit::Standing>, StoreError> {
        self.answer().await.map(|_| Vec::new())
    }

    async fn reset(
        &self,
        _: &Charge<'_>,
        _: Option<usize>,
        _: crate::limit::Forget,
    ) -> Result<(), StoreError> {
        self.answer().await.map(|_| ())
    }

    async fn penalties(&self, _: u64) -> Result<Vec<crate::limit::penalty::Served>, StoreError> {
        self.answer().await.map(|_| Vec::new())
    }

    async fn kept(&self, _: &str, _: usize, _: &Limit, _: u64) -> Result<Vec<Kept>, StoreError> {
        self.answer().await.map(|_| Vec::new())
    }

    async fn announce_rules(&self, digest: &str) -> Result<Vec<String>, StoreError> {
        self.answer().await.map(|_| vec![digest.to_owned()])
    }

    async fn probe(&self, _: &FakeNode) -> Result<(), StoreError> {
        self.answer().await.map(|_| ())
    }

    fn reconnect_node(&self, _: &FakeNode) {}

    fn timeout(&self) -> Duration {
        TIMEOUT
    }

    fn given_back(&self) -> &GivenBack {
        &self.given_back
    }

    fn tag_buckets(&self, charge: &Charge<'_>) -> Box<[u16]> {
        Box::new([GivenBack::bucket(charge.route.as_bytes())])
    }
}

fn allowed() -> Decision {
    Decision {
        allowed: true,
        remaining: 5,
        ..Decision::default()
    }
}

fn denied() -> Decision {
    Decision {
        allowed: false,
        retry_after_ms: 60_000,
        next_ms: 60_000,
        ..Decision::default()
    }
}

fn guarded(on_error: OnError, fake: Fake) -> Guarded<Fake> {
    Guarded::new(fake, (on_error, 1), 64, Metrics::new().store())
}

/// Six requests a minute, for client `a` on route `api`.
struct Request {
    route: Arc<str>,
    client: ClientId,
    limits: [Limit; 1],
}

impl Request {
    fn new() -> Self {
        Self {
            route: "api".into(),
            client: ClientId::header("a"),
            limits: [Limit::new(Algorithm::FixedWindow, 6, 60_000)],
        }
    }

    fn charge(&self) -> Charge<'_> {
        Charge {
            route: &self.route,
            client: &self.client,
            limits: &self.limits,
            keys: &[],
            cost: 1,
            settle: None,
        }
    }
}

/// The answers to `n` requests while the store is down, with `on_error`.
async fn answers_in_an_outage(on_error: OnError, n: usize) -> (Vec<Answer>, Guarded<Fake>) {
    let guarded = guarded(on_error, Fake::new(LONG, Told::Outage));
    let request = Request::new();
    let mut answers = Vec::new();
    for _ in 0..n {
        answers.push(guarded.decide(request.charge()).await);
    }
    (answers, guarded)
}

const THRESHOLD: usize = DEFAULT_THRESHOLD as usize;

#[tokio::test]
async fn an_outage_with_on_error_allow_lets_requests_through_and_opens_the_breaker() {
    let (answers, guarded) = answers_in_an_outage(OnError::Allow, THRESHOLD + 3).await;
    let through = Answer::Unavailable {
        deny: false,
        retry_after_ms: 0,
    };
    assert!(answers.iter().all(|a| *a == through), "{answers:?}");
    assert_eq!(guarded.store.asked(), THRESHOLD, "not asked once open");
    assert!(!guarded.ready());
    assert_eq!(guarded.refusal(), None, "an outage is no refusal");
}

#[tokio::test]
async fn an_outage_with_on_error_deny_refuses_requests_and_opens_the_breaker() {
    let (answers, guarded) = answers_in_an_outage(OnError::Deny, THRESHOLD + 3).await;
    let refused = Answer::Unavailable {
        deny: true,
        retry_after_ms: 1_000,
    };
    assert!(answers.iter().all(|a| *a == refused), "{answers:?}");
    assert_eq!(guarded.store.asked(), THRESHOLD, "not asked once open");
    assert!(!guarded.ready());
}

#[tokio::test]
async fn an_outage_with_on_error_local_counts_in_memory_and_opens_the_breaker() {
    let (answers, guarded) = answers_in_an_outage(OnError::Local, 7).await;
    let decided: Vec<(bool, bool)> = answers
        .iter()
        .map(|a| match a {
            Answer::Decided(d) => (d.allowed, d.local),
            Answer::Unavailable { .. } => panic!("on_error = local decides: {a:?}"),
        })
        .collect();
    // Six a minute, counted here: the seventh is refused, by this instance.
    assert_eq!(
        decided,
        [[(true, true)].repeat(6), vec![(false, true)]].concat()
    );
    assert_eq!(guarded.store.asked(), THRESHOLD, "not asked once open");
    assert!(!guarded.ready());
}

#[tokio::test]
async fn a_refusal_is_reported_as_a_refusal_not_an_outage() {
    let guarded = guarded(OnError::Deny, Fake::new(LONG, Told::Refuse));
    let request = Request::new();
    let answer = guarded.decide(request.charge()).await;
    assert_eq!(
        answer,
        Answer::Unavailable {
            deny: true,
            retry_after_ms: 1_000
        }
    );
    let why = guarded.refusal().expect("the refusal is remembered");
    assert!(why.contains("WRONGPASS"), "{why}");
    // Fixed on the server: the next answer ends it.
    guarded.store.tell(Told::Decide(allowed()));
    assert_eq!(
        guarded.decide(request.charge()).await,
        Answer::Decided(allowed())
    );
    assert_eq!(guarded.refusal(), None);
}

#[tokio::test(start_paused = true)]
async fn a_slow_node_past_its_deadline_counts_as_a_failure() {
    let guarded = guarded(OnError::Deny, Fake::new(LONG, Told::Late(TIMEOUT / 2)));
    let request = Request::new();
    // Within its deadline: decided.
    assert_eq!(
        guarded.decide(request.charge()).await,
        Answer::Decided(allowed())
    );
    guarded.store.tell(Told::Late(TIMEOUT * 10));
    for _ in 0..THRESHOLD + 2 {
        let answer = guarded.decide(request.charge()).await;
        assert!(
            matches!(answer, Answer::Unavailable { deny: true, .. }),
            "{answer:?}"
        );
    }
    assert_eq!(guarded.store.asked(), 1 + THRESHOLD, "not asked once open");
    assert!(!guarded.ready());
    assert_eq!(guarded.refusal(), None);
}

#[tokio::test]
async fn recovery_closes_the_breaker_and_decisions_go_to_the_store_again() {
    // No cooldown: once open, each decision is the breaker's probe.
    let guarded = guarded(OnError::Deny, Fake::new(0, Told::Outage));
    let request = Request::new();
    for _ in 0..THRESHOLD {
        guarded.decide(request.charge()).await;
    }
    assert!(!guarded.ready());
    // A failed probe leaves it open.
    assert!(matches!(
        guarded.decide(request.charge()).await,
        Answer::Unavailable { deny: true, .. }
    ));
    assert!(!guarded.ready());
    guarded.store.tell(Told::Decide(allowed()));
    assert_eq!(
        guarded.decide(request.charge()).await,
        Answer::Decided(allowed())
    );
    assert!(guarded.ready());
    let asked = guarded.store.asked();
    assert_eq!(
        guarded.decide(request.charge()).await,
        Answer::Decided(allowed())
    );
    assert_eq!(guarded.store.asked(), asked + 1);
}

#[tokio::test]
async fn the_recovery_probe_closes_the_breaker_without_a_request() {
    let guarded = guarded(OnError::Deny, Fake::new(0, Told::Outage));
    let request = Request::new();
    for _ in 0..THRESHOLD {
        guarded.decide(request.charge()).await;
    }
    guarded.recover().await;
    assert!(!guarded.ready(), "the store is still down");
    guarded.store.tell(Told::Decide(allowed()));
    guarded.recover().await;
    assert!(guarded.ready());
    assert_eq!(
        guarded.decide(request.charge()).await,
        Answer::Decided(allowed())
    );
}

#[tokio::test]
async fn a_remembered_denial_answers_without_asking_the_store_until_units_come_back() {
    let guarded = guarded(OnError::Allow, Fake::new(LONG, Told::Decide(denied())));
    let request = Request::new();
    let refused = |answer: Answer| matches!(answer, Answer::Decided(d) if !d.allowed);
    assert!(refused(guarded.decide(request.charge()).await));
    assert!(refused(guarded.decide(request.charge()).await));
    assert_eq!(guarded.store.asked(), 1, "the second is remembered");
    // Another instance's settlement gave units back to the key.
    guarded.store.given_back.note(request.route.as_bytes());
    assert!(refused(guarded.decide(request.charge()).await));
    assert_eq!(guarded.store.asked(), 2);
    assert!(refused(guarded.decide(request.charge()).await));
    assert_eq!(guarded.store.asked(), 2, "remembered again");
    // This instance's own settlement gives units back.
    let settlement = Charge {
        cost: 0,
        settle: Some(Settlement {
            at_ms: 0,
            reserved: 1,
            local: false,
            kind: crate::limit::Settled::Reservation,
        }),
        ..request.charge()
    };
    assert!(guarded.settle(settlement).await.is_ok());
    assert_eq!(guarded.store.asked(), 3);
    assert!(refused(guarded.decide(request.charge()).await));
    assert_eq!(guarded.store.asked(), 4, "asked again");
}

#[tokio::test]
async fn a_message_already_sent_but_not_yet_read_ends_a_remembered_denial() {
    let guarded = guarded(OnError::Allow, Fake::new(LONG, Told::Decide(denied())));
    let request = Request::new();
    let refused = |answer: Answer| matches!(answer, Answer::Decided(d) if !d.allowed);
    assert!(refused(guarded.decide(request.charge()).await));
    assert!(refused(guarded.decide(request.charge()).await));
    assert_eq!(guarded.store.asked(), 1, "the second is remembered");
    // An operator's credit went through another instance: its message is
    // in this instance's subscription, which reads it only in a round.
    guarded.store.tell(Told::Decide(allowed()));
    let mut rounds = guarded.store.given_back.barrier().subscription();
    let slow_listener = async {
        let round = rounds.asked().await;
        guarded.store.given_back.note(request.route.as_bytes());
        rounds.answer(round);
    };
    let (answer, ()) = tokio::join!(guarded.decide(request.charge()), slow_listener);
    assert_eq!(answer, Answer::Decided(allowed()));
    assert_eq!(guarded.store.asked(), 2);
}

#[tokio::test]
async fn a_denial_is_not_refused_from_memory_while_a_subscription_does_not_answer() {
    let guarded = guarded(OnError::Allow, Fake::new(LONG, Told::Decide(denied())));
    let request = Request::new();
    let refused = |answer: Answer| matches!(answer, Answer::Decided(d) if !d.allowed);
    assert!(refused(guarded.decide(request.charge()).await));
    let _silent = guarded.store.given_back.barrier().subscription();
    assert!(refused(guarded.decide(request.charge()).await));
    assert_eq!(guarded.store.asked(), 2, "the store decided, not memory");
}
