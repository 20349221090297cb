//! The decider shape shared by every aggregate, and the given/when/then harness that tests them.
//!
//! Following Jérémie Chassaing's Decider: `decide(&state, &command) -> Result<Vec<Event>, Error>`,
//! `evolve(state, &event) -> state`, `initial_state()`. Projections, the CLI's `audit verify` and
//! command handling all fold with the same `evolve`, so there is one meaning for every event.

/// A pure aggregate: the only place where the rules of one consistency boundary live.
pub trait Decider {
    type State;
    type Command;
    type Event;
    type Error;

    /// The state before any event of the stream.
    fn initial_state() -> Self::State;

    /// Decide what happens when `command` meets `state`. An empty vector means "already done"
    /// (idempotent repeat), an error means "refused, nothing happens".
    fn decide(
        state: &Self::State,
        command: &Self::Command,
    ) -> Result<Vec<Self::Event>, Self::Error>;

    /// Apply one past event. Must be total: an event that was stored is a fact and cannot be refused.
    fn evolve(state: Self::State, event: &Self::Event) -> Self::State;

    /// Fold a stream's events into its current state.
    fn fold<'a, I>(events: I) -> Self::State
    where
        I: IntoIterator<Item = &'a Self::Event>,
        Self::Event: 'a,
    {
        events.into_iter().fold(Self::initial_state(), Self::evolve)
    }
}

/// Given/when/then on events: `given::<D>(past).when(command).then(expected)`.
///
/// Used by the domain's unit tests; it panics with both sides printed when an expectation fails.
pub fn given<D: Decider>(past_events: &[D::Event]) -> Given<D> {
    Given {
        state: D::fold(past_events),
    }
}

/// The state folded from the given events, waiting for a command.
#[derive(Debug)]
pub struct Given<D: Decider> {
    state: D::State,
}

impl<D: Decider> Given<D> {
    pub fn when(self, command: D::Command) -> When<D> {
        let outcome = D::decide(&self.state, &command);
        When { outcome }
    }
}

/// The outcome of a decision under test.
#[derive(Debug)]
pub struct When<D: Decider> {
    outcome: Result<Vec<D::Event>, D::Error>,
}

impl<D: Decider> When<D>
where
    D::Event: PartialEq + std::fmt::Debug,
    D::Error: PartialEq + std::fmt::Debug,
{
    /// Expect exactly these new events.
    #[track_caller]
    pub fn then(self, expected_events: &[D::Event]) {
        match self.outcome {
            Ok(events) => assert_eq!(events.as_slice(), expected_events, "unexpected events"),
            Err(error) => panic!("expected events {expected_events:?}, got error {error:?}"),
        }
    }

    /// Expect this refusal.
    #[track_caller]
    pub fn then_error(self, expected_error: D::Error) {
        match self.outcome {
            Ok(events) => panic!("expected error {expected_error:?}, got events {events:?}"),
            Err(error) => assert_eq!(error, expected_error, "unexpected error"),
        }
    }
}

#[cfg(test)]
mod tests {
    //! The harness itself on a counter that may not go below zero.
    use super::*;

    #[derive(Debug)]
    struct Counter;

    #[derive(Debug, PartialEq)]
    enum CounterEvent {
        Incremented,
        Decremented,
    }

    #[derive(Debug, PartialEq)]
    enum CounterError {
        WouldGoNegative,
    }

    enum CounterCommand {
        Increment,
        Decrement,
    }

    impl Decider for Counter {
        type State = u32;
        type Command = CounterCommand;
        type Event = CounterEvent;
        type Error = CounterError;

        fn initial_state() -> u32 {
            0
        }

        fn decide(
            state: &u32,
            command: &CounterCommand,
        ) -> Result<Vec<CounterEvent>, CounterError> {
            match command {
                CounterCommand::Increment => Ok(vec![CounterEvent::Incremented]),
                CounterCommand::Decrement if *state == 0 => Err(CounterError::WouldGoNegative),
                CounterCommand::Decrement => Ok(vec![CounterEvent::Decremented]),
            }
        }

        fn evolve(state: u32, event: &CounterEvent) -> u32 {
            match event {
                CounterEvent::Incremented => state + 1,
                CounterEvent::Decremented => state - 1,
            }
        }
    }

    #[test]
    fn given_no_events_when_decrement_then_refused() {
        given::<Counter>(&[])
            .when(CounterCommand::Decrement)
            .then_error(CounterError::WouldGoNegative);
    }

    #[test]
    fn given_one_increment_when_decrement_then_decremented() {
        given::<Counter>(&[CounterEvent::Incremented])
            .when(CounterCommand::Decrement)
            .then(&[CounterEvent::Decremented]);
    }

    #[test]
    #[should_panic(expected = "unexpected events")]
    fn the_harness_fails_on_wrong_events() {
        given::<Counter>(&[])
            .when(CounterCommand::Increment)
            .then(&[CounterEvent::Decremented]);
    }
}
