//! Rebuild when a migration is added or changed: `refinery::embed_migrations!` reads the
//! `migrations/` directory at compile time, and Cargo does not watch it otherwise.

fn main() {
    println!("cargo:rerun-if-changed=migrations");
}
