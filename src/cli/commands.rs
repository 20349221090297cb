//! The command line as a closed set: `Cli`, its subcommands and their arguments (clap derives
//! the parsing; an unknown or trailing argument is refused). `run` (the parent module) matches on
//! them.

use super::*;

#[derive(Debug, Parser)]
#[command(
    name = "zhihui",
    version,
    about = "zhihui: text-to-image backend and its admin tools"
)]
pub struct Cli {
    /// A TOML settings file, layered over the built-in defaults and under ZHIHUI_* variables.
    #[arg(long, global = true, env = "ZHIHUI_CONFIG")]
    pub config: Option<PathBuf>,
    /// Log format; overrides `log.format`.
    #[arg(long, global = true, value_enum)]
    pub log_format: Option<LogFormat>,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Serve the HTTP API (runs pending migrations first unless database.migrate_on_start=false).
    Serve,
    /// Apply pending database migrations and exit.
    Migrate,
    /// Inspect the audit trail.
    Audit {
        #[command(subcommand)]
        command: AuditCommand,
    },
    /// Manage users (bootstrap an admin).
    Users {
        #[command(subcommand)]
        command: UsersCommand,
    },
    /// Rebuild read models from the events into fresh tables, swapped in only when complete.
    Replay {
        /// One projection (`ledger`, `users`); all of them when absent.
        #[arg(long, value_parser = parse_projection)]
        projection: Option<ProjectionName>,
        /// Events per transaction while rebuilding.
        #[arg(long, default_value_t = REPLAY_BATCH_SIZE_DEFAULT)]
        batch_size: usize,
        /// No progress bar (logs and scripts).
        #[arg(long)]
        quiet: bool,
    },
    /// Read the event log.
    Events {
        #[command(subcommand)]
        command: EventsCommand,
    },
    /// The task queue in Redis.
    Queue {
        #[command(subcommand)]
        command: QueueCommand,
    },
    /// Redeem code batches.
    Codes {
        #[command(subcommand)]
        command: CodesCommand,
    },
    /// Daily check-in.
    Checkins {
        #[command(subcommand)]
        command: CheckinsCommand,
    },
    /// The creators' gallery.
    Gallery {
        #[command(subcommand)]
        command: GalleryCommand,
    },
    /// Flash-sale promotions.
    Promotions {
        #[command(subcommand)]
        command: PromotionsCommand,
    },
    /// Statistics for admins.
    Stats {
        #[command(subcommand)]
        command: StatsCommand,
    },
    /// Stored images.
    Images {
        #[command(subcommand)]
        command: ImagesCommand,
    },
    /// The pool of ComfyUI servers, changed at run time (every process follows).
    Backends {
        #[command(subcommand)]
        command: BackendsCommand,
    },
}

#[derive(Debug, Subcommand)]
pub enum BackendsCommand {
    /// Every server: state, capacity, prompts in flight, models, version, last error, tasks.
    List {
        #[arg(long)]
        json: bool,
    },
    /// Add a server (the leader connects to it and reads its models).
    Add {
        name: String,
        url: String,
        #[arg(long, default_value_t = 1)]
        capacity: u32,
    },
    /// No new prompt goes to it; what runs there finishes.
    Drain { name: String },
    /// Back in service after a drain.
    Resume { name: String },
    /// Remove a server nothing runs on.
    Remove { name: String },
    /// Give a server another address or capacity (refused while a prompt runs there).
    Reconfigure {
        name: String,
        url: String,
        #[arg(long, default_value_t = 1)]
        capacity: u32,
    },
    /// Make the pool what `dispatch.backends` says (the configuration seeds the pool only at
    /// the first start): add, reconfigure and remove servers, each recorded as a pool event. A
    /// server still running a prompt is left as it is and reported; exits non-zero then.
    ApplyConfig,
}

#[derive(Debug, Subcommand)]
pub enum ImagesCommand {
    /// Print an image's AI-generated labels (the PNG `AIGC` text and the XMP) and whether each
    /// one's ReservedCode1 checks out under `labels.signing_key`. Exits non-zero when the label
    /// the format needs is missing or does not check out.
    Inspect {
        /// A file, or the id of a stored image (read from `dispatch.images_directory`).
        target: String,
        #[arg(long)]
        json: bool,
    },
}

#[derive(Debug, Subcommand)]
pub enum GalleryCommand {
    /// Write the gallery's Redis keys back from the work, like and follow streams (like sets,
    /// follower sets, the new list and the hot ranking; inboxes are rebuilt when their owners
    /// read them). Every write is idempotent: safe while users like and follow.
    Rebuild,
}

#[derive(Debug, Subcommand)]
pub enum CheckinsCommand {
    /// Write the Redis month bitmaps back from the check-in streams (after Redis lost them;
    /// reads also rebuild them lazily). Bits are only ever set: nothing is lost by running it
    /// while users check in.
    Rebuild {
        /// One user (id); every user the `checkins` read model knows when absent.
        #[arg(long)]
        user: Option<uuid::Uuid>,
    },
}

#[derive(Debug, Subcommand)]
pub enum PromotionsCommand {
    /// A promotion from its stream, with its claims (from the read model) and the claims parked.
    Show {
        promotion: uuid::Uuid,
        #[arg(long)]
        json: bool,
    },
}

#[derive(Debug, Subcommand)]
pub enum StatsCommand {
    /// Daily active users: each day's count and the distinct users over the range
    /// (HyperLogLog estimates).
    ActiveUsers {
        /// First day (YYYY-MM-DD); six days before --to when absent.
        #[arg(long)]
        from: Option<chrono::NaiveDate>,
        /// Last day (YYYY-MM-DD, included); today when absent.
        #[arg(long)]
        to: Option<chrono::NaiveDate>,
        #[arg(long)]
        json: bool,
    },
}

#[derive(Debug, Subcommand)]
pub enum CodesCommand {
    /// Create a batch and issue its codes (in pages, here; a running server's generator may
    /// share the work: pages are fenced, no serial is issued twice).
    Issue {
        /// 1 to 1,000,000 codes.
        #[arg(long)]
        count: u32,
        /// Points per code (e.g. 50 or 12.5).
        #[arg(long)]
        points: rust_decimal::Decimal,
        /// Start of the window (RFC 3339); now when absent.
        #[arg(long)]
        valid_from: Option<chrono::DateTime<chrono::Utc>>,
        /// End of the window (RFC 3339, excluded).
        #[arg(long)]
        valid_until: chrono::DateTime<chrono::Utc>,
        #[arg(long, default_value = "")]
        note: String,
    },
    /// Write a batch's issued codes as CSV (to standard output, or --output).
    Export {
        batch: uuid::Uuid,
        #[arg(long)]
        output: Option<PathBuf>,
    },
    /// A batch and its progress.
    Show { batch: uuid::Uuid },
    /// Revoke a batch: its unredeemed codes stop working.
    Revoke {
        batch: uuid::Uuid,
        #[arg(long)]
        reason: String,
    },
}

#[derive(Debug, Subcommand)]
pub enum QueueCommand {
    /// Put every queued task back in the Redis queue at the score its events give it (after
    /// Redis lost its data), and take out what has left.
    Rebuild,
}

/// Replay page size: one transaction per page. Large enough to amortise the commit and the two
/// set-based statements of a page; small enough that each transaction is short (a long one holds
/// the global log's horizon back for every reader).
pub const REPLAY_BATCH_SIZE_DEFAULT: usize = 10_000;

fn parse_projection(name: &str) -> Result<ProjectionName, String> {
    ProjectionName::parse(name).ok_or_else(|| {
        let known: Vec<&str> = ProjectionName::ALL.iter().map(|p| p.as_str()).collect();
        format!("unknown projection {name:?}; known: {}", known.join(", "))
    })
}

#[derive(Debug, Subcommand)]
pub enum EventsCommand {
    /// Every event of one stream, oldest first.
    Show {
        /// The stream, e.g. `account-<user id>`, `revenue`, `user-name-alice`.
        stream: String,
        /// One JSON object per line instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Follow the global log: print events as they are committed.
    Tail {
        /// Start from the beginning of the log instead of from now.
        #[arg(long)]
        from_start: bool,
        /// Only streams starting with this prefix (repeatable).
        #[arg(long = "stream-prefix")]
        stream_prefixes: Vec<String>,
        /// Exit after this many events.
        #[arg(long)]
        count: Option<u64>,
        /// One JSON object per line instead of text.
        #[arg(long)]
        json: bool,
    },
}

#[derive(Debug, Subcommand)]
pub enum AuditCommand {
    /// Fold every stream again and compare with every read model; prints each difference and
    /// exits non-zero if there is one.
    Verify,
    /// One account's movements, from its events, oldest first.
    Account {
        /// The user: a user id or a username.
        user: String,
        /// Only movements at or after this time (RFC 3339, e.g. 2027-01-15T00:00:00Z).
        #[arg(long)]
        since: Option<chrono::DateTime<chrono::Utc>>,
        /// Only movements of this kind (grant, freeze, deduct, return, charge, refund,
        /// redeem_code, check_in_bonus, promotion).
        #[arg(long)]
        kind: Option<String>,
        /// JSON (one array) instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// One redeem code's life: its batch, its redemption and its credit, from their streams.
    Code {
        /// The code as printed (case, hyphens and spaces do not matter).
        code: String,
    },
    /// The settlements the settlement reconciler made itself (holds of finished tasks settled or
    /// released, fees of abandoned prioritises refunded), oldest first.
    Repairs {
        /// Only repairs made at or after this time (RFC 3339).
        #[arg(long)]
        since: Option<chrono::DateTime<chrono::Utc>>,
        /// JSON (one array) instead of a table.
        #[arg(long)]
        json: bool,
    },
}

#[derive(Debug, Subcommand)]
pub enum UsersCommand {
    /// Create a user with a username and password. Prompts for the password twice on a terminal.
    Create {
        /// The username (3 to 32 letters, digits, `_`, `-`, `.`; starts with a letter).
        name: String,
        /// Give the user the admin role.
        #[arg(long)]
        admin: bool,
        /// Read the password from the first line of standard input instead of prompting.
        #[arg(long)]
        password_stdin: bool,
    },
}
