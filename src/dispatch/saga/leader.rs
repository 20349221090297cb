//! The dispatcher of one process: its servers, its lane (a thread of its own for the saga),
//! and leadership: [`Dispatcher::lead`] takes the leader lease and starts a [`Saga`];
//! [`Dispatcher::run`] keeps trying while the process lives.

use super::*;

/// What a dispatcher process needs; [`Dispatcher::lead`] turns it into a running [`Saga`].
#[derive(Clone)]
pub struct Dispatcher {
    pub(super) tasks: TaskService,
    pub(super) store: AnyEventStore,
    pub(super) pool: Pool,
    pub(super) leases: Leases,
    pub(super) notifier: Notifier,
    pub(super) images: ImageStore,
    pub(super) labeller: Labeller,
    pub(super) clock: Clock,
    pub(super) settings: DispatchSettings,
    /// The pool at run time (the configuration's servers seed it at the first start).
    pub(super) backend_pool: PoolService,
    /// The configured servers (`dispatch.backends`): the pool's seed.
    pub(super) configured: Arc<Vec<BackendSettings>>,
    pub(super) instance: String,
    /// The dispatch path's own thread: the saga (in `serve`), its sockets and its posts.
    pub(super) lane: Arc<Lane>,
    /// The shared runtime: everything the saga starts that is not on the dispatch path
    /// (recording, settling, preparing, fetching results, looking prompts up).
    pub(super) work: tokio::runtime::Handle,
}

/// A current-thread runtime on an OS thread of its own. On the shared runtime a woken saga or a
/// post waits in line behind every ready task (downloads, appends, HTTP requests); here it runs
/// at once, and the kernel schedules a mostly idle thread promptly. Stops when dropped.
pub(super) struct Lane {
    pub(super) handle: tokio::runtime::Handle,
    pub(super) _stop: tokio::sync::oneshot::Sender<()>,
}

impl Lane {
    fn start() -> anyhow::Result<Lane> {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .context("building the dispatch lane's runtime")?;
        let handle = runtime.handle().clone();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        std::thread::Builder::new()
            .name("zhihui-dispatch".into())
            .spawn(move || {
                // Until the last dispatcher handle is dropped; then its tasks are dropped too.
                drop(runtime.block_on(stopped));
            })
            .context("starting the dispatch lane's thread")?;
        Ok(Lane {
            handle,
            _stop: stop,
        })
    }
}

impl std::fmt::Debug for Dispatcher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Dispatcher")
            .field("instance", &self.instance)
            .field(
                "configured",
                &self.configured.iter().map(|b| &b.name).collect::<Vec<_>>(),
            )
            .finish_non_exhaustive()
    }
}

impl Dispatcher {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        tasks: TaskService,
        store: AnyEventStore,
        pool: Pool,
        leases: Leases,
        notifier: Notifier,
        images: ImageStore,
        labeller: Labeller,
        clock: Clock,
        settings: DispatchSettings,
        backend_pool: PoolService,
    ) -> anyhow::Result<Dispatcher> {
        let configured = settings.parsed_backends()?;
        Ok(Dispatcher {
            tasks,
            store,
            pool,
            leases,
            notifier,
            images,
            labeller,
            clock,
            settings,
            backend_pool,
            configured: Arc::new(configured),
            instance: Uuid::now_v7().simple().to_string(),
            lane: Arc::new(Lane::start()?),
            work: tokio::runtime::Handle::try_current()
                .context("a dispatcher is built inside the runtime")?,
        })
    }

    pub fn leases(&self) -> &Leases {
        &self.leases
    }

    /// The configured servers' names (the pool's seed).
    pub fn backend_names(&self) -> Vec<String> {
        self.configured.iter().map(|b| b.name.clone()).collect()
    }

    /// The configured servers (`dispatch.backends`): the pool's seed, compared with it.
    pub fn configured(&self) -> &[BackendSettings] {
        &self.configured
    }

    pub fn backend_pool(&self) -> &PoolService {
        &self.backend_pool
    }

    /// Become the leader if nobody is, and start the saga: sockets, the task-event subscription,
    /// the queue rebuilt from the events, every task in flight adopted. `None` while another
    /// process leads.
    pub async fn lead(&self) -> anyhow::Result<Option<Saga>> {
        let Some(term) = self
            .leases
            .acquire(&self.instance, self.settings.leader_lease_ms)
            .await?
        else {
            return Ok(None);
        };
        tracing::info!(
            fencing_token = term.fencing_token,
            "dispatcher leader elected"
        );
        // The pool as recorded (seeded from the configuration at the very first start): a new
        // leader starts from the same pool the last one had.
        let seeded = async {
            let pool = self.backend_pool.seed(&self.configured).await?;
            self.backend_pool.hold(&pool).await?;
            anyhow::Ok(pool)
        };
        let pool = match seeded.await {
            Ok(pool) => pool,
            Err(error) => {
                drop(self.leases.resign(&term).await);
                return Err(error);
            }
        };
        let mut saga = Saga::start(self.clone(), term.clone(), pool).await?;
        // The rebuild reads the task events after the read model's checkpoint, which can take
        // longer than a lease: keep renewing meanwhile.
        let keep_lease = async {
            let renew = Duration::from_millis(self.settings.leader_renew_ms);
            loop {
                tokio::time::sleep(renew).await;
                if !self
                    .leases
                    .renew(&term, self.settings.leader_lease_ms)
                    .await?
                {
                    return anyhow::Ok(());
                }
            }
        };
        let startup = async {
            saga.dispatcher.tasks.rebuild_queue().await?;
            saga.adopt_orphans().await?;
            saga.adopt_leased().await
        };
        let started = tokio::select! {
            started = startup => started,
            lost = keep_lease => Err(lost.err().unwrap_or_else(|| LostLeadership.into())),
        };
        match started {
            Ok(()) => Ok(Some(saga)),
            Err(error) => {
                saga.resign().await;
                Err(error)
            }
        }
    }

    /// [`Dispatcher::run`] on the dispatch lane's thread.
    pub fn spawn_run(self) -> tokio::task::JoinHandle<()> {
        let lane = self.lane.handle.clone();
        lane.spawn(self.run())
    }

    /// Run `future` on the dispatch lane's thread, where `serve` runs the saga (benchmarks
    /// drive a saga there step by step).
    pub fn spawn_on_lane<F>(&self, future: F) -> tokio::task::JoinHandle<F::Output>
    where
        F: std::future::Future + Send + 'static,
        F::Output: Send + 'static,
    {
        self.lane.handle.spawn(future)
    }

    /// Lead whenever possible, forever: a lost lease ends the saga (its sockets close, its memory
    /// is dropped) and the process competes again; the next saga resumes from the events.
    pub async fn run(self) {
        let retry = Duration::from_millis(self.settings.leader_retry_ms);
        loop {
            match self.lead().await {
                Ok(Some(saga)) => Box::pin(saga.run()).await,
                Ok(None) => {}
                Err(error) => {
                    tracing::warn!(error = %crate::platform::telemetry::error_chain(&error), "dispatcher could not start")
                }
            }
            tokio::time::sleep(retry).await;
        }
    }
}
