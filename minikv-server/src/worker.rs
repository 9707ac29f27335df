//! The engine's thread: owns the model and the [`Engine`], takes requests and
//! cancellations over a channel, steps while anything is live, and sends each
//! request's tokens to its own channel. A request whose receiver is gone (the
//! client left) is cancelled at once, which frees its KV bytes.

use crate::metrics::Metrics;
use minikv_core::{CacheBuilder, CacheConfig, Error};
use minikv_engine::{Engine, EngineConfig, Event, Finished, Request, TokenLogprob};
use minikv_models::LanguageModel;
use std::collections::HashMap;
use std::sync::Arc;
use std::sync::mpsc::{Receiver, TryRecvError};
use tokio::sync::mpsc::UnboundedSender;

/// What the HTTP side asks of the engine.
pub enum Cmd {
    /// Queue a request; its events go to `tx`.
    Submit {
        /// The request.
        req: Request,
        /// Where its events go.
        tx: UnboundedSender<Out>,
    },
    /// Cancel a request (the client left or a stop string matched).
    Cancel(u64),
}

/// What the engine tells a request's handler.
#[derive(Debug)]
pub enum Out {
    /// Queued.
    Accepted,
    /// Refused at submission (why).
    Rejected(Error),
    /// A token.
    Token {
        /// Its id.
        token: u32,
        /// Its log-probability, if asked for.
        logprob: Option<TokenLogprob>,
    },
    /// The sequence ended.
    Done(Box<Finished>),
}

/// Runs until every sender of `rx` is gone and nothing is live.
pub fn run(
    model: Box<dyn LanguageModel>,
    builder: CacheBuilder,
    cache: CacheConfig,
    cfg: EngineConfig,
    rx: Receiver<Cmd>,
    metrics: Arc<Metrics>,
    ready: std::sync::mpsc::Sender<minikv_core::Result<()>>,
) -> minikv_core::Result<()> {
    let mut engine = match Engine::new(model.as_ref(), builder, cache, cfg) {
        Ok(e) => {
            let _ = ready.send(Ok(()));
            e
        }
        Err(e) => {
            let _ = ready.send(Err(e));
            return Ok(());
        }
    };
    metrics.engine(engine.stats(), 0, 0);
    let mut live: HashMap<u64, UnboundedSender<Out>> = HashMap::new();
    let (mut prompt_seen, mut steps_seen) = (0u64, 0u64);
    let handle =
        |engine: &mut Engine<'_>, live: &mut HashMap<u64, UnboundedSender<Out>>, c: Cmd| match c {
            Cmd::Submit { req, tx } => {
                let id = req.id;
                match engine.submit(req) {
                    Ok(()) => {
                        if tx.send(Out::Accepted).is_ok() {
                            live.insert(id, tx);
                        } else {
                            engine.cancel(id);
                        }
                    }
                    Err(e) => {
                        let _ = tx.send(Out::Rejected(e));
                    }
                }
            }
            Cmd::Cancel(id) => {
                engine.cancel(id);
            }
        };
    loop {
        if engine.is_idle() {
            match rx.recv() {
                Ok(c) => handle(&mut engine, &mut live, c),
                Err(_) => return Ok(()),
            }
        }
        loop {
            match rx.try_recv() {
                Ok(c) => handle(&mut engine, &mut live, c),
                Err(TryRecvError::Empty) => break,
                Err(TryRecvError::Disconnected) => {
                    // Shutting down: end what is live.
                    let ids: Vec<u64> = live.keys().copied().collect();
                    for id in ids {
                        engine.cancel(id);
                    }
                    break;
                }
            }
        }
        let events = match engine.step() {
            Ok(ev) => ev,
            Err(e) => {
                // Only admission can fail here (a cache that cannot be
                // built): fail the live requests, keep serving.
                eprintln!("minikv serve: engine step failed: {e}");
                for (id, tx) in live.drain() {
                    engine.cancel(id);
                    let _ = tx.send(Out::Rejected(Error::Input(format!(
                        "the engine could not run the request: {e}"
                    ))));
                }
                continue;
            }
        };
        for ev in events {
            match ev {
                Event::Token { id, token, logprob } => {
                    metrics.token();
                    let gone = live
                        .get(&id)
                        .is_none_or(|tx| tx.send(Out::Token { token, logprob }).is_err());
                    if gone {
                        live.remove(&id);
                        engine.cancel(id);
                    }
                }
                Event::Finished(f) => {
                    metrics.finished(&f);
                    if let Some(tx) = live.remove(&f.id) {
                        let _ = tx.send(Out::Done(Box::new(f)));
                    }
                }
            }
        }
        let s = engine.stats();
        metrics.engine(s, s.prompt_tokens - prompt_seen, s.steps - steps_seen);
        prompt_seen = s.prompt_tokens;
        steps_seen = s.steps;
    }
}
