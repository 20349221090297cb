#![allow(clippy::unwrap_used)]
use super::*;
use crate::decider::given;

fn at(seconds: i64) -> DateTime<Utc> {
    DateTime::from_timestamp(1_800_000_000 + seconds, 0).unwrap()
}

fn alice() -> UserId {
    UserId::from_uuid(Uuid::from_u128(1))
}

fn hash(tag: &str) -> PasswordHash {
    PasswordHash::parse(&format!("$argon2id$v=19$m=19456,t=2,p=1${tag}")).unwrap()
}

fn registered_alice() -> UserEvent {
    UserEvent::Registered(UserRegistered {
        user_id: alice(),
        username: Some(Username::parse("alice").unwrap()),
        password_hash: Some(hash("one")),
        phone: None,
        role: Role::User,
        registered_at: at(0),
    })
}

fn create_key(key_id: u128, scopes: Vec<Scope>, at_seconds: i64) -> UserCommand {
    UserCommand::CreateApiKey {
        key_id: Uuid::from_u128(key_id),
        name: "  商城后台 ".into(),
        scopes,
        digest: format!("digest-{key_id}"),
        expires_at: Some(at(at_seconds + 3600)),
        requests_per_minute: 600,
        at: at(at_seconds),
    }
}

fn key_created(key_id: u128, scopes: Vec<Scope>, at_seconds: i64) -> UserEvent {
    UserEvent::ApiKeyCreated(ApiKeyCreated {
        key_id: Uuid::from_u128(key_id),
        name: "商城后台".into(),
        scopes,
        digest: format!("digest-{key_id}"),
        expires_at: Some(at(at_seconds + 3600)),
        requests_per_minute: 600,
        created_at: at(at_seconds),
    })
}

#[test]
fn given_a_user_when_create_key_then_created_once_with_its_scopes_sorted() {
    given::<User>(&[registered_alice()])
        .when(create_key(
            7,
            vec![Scope::TasksRead, Scope::TasksWrite, Scope::TasksRead],
            1,
        ))
        .then(&[key_created(7, vec![Scope::TasksWrite, Scope::TasksRead], 1)]);
    // The same request again is done already; another digest under the id is refused.
    given::<User>(&[
        registered_alice(),
        key_created(7, vec![Scope::TasksRead], 1),
    ])
    .when(create_key(7, vec![Scope::TasksRead], 2))
    .then(&[]);
    let mut other = create_key(7, vec![Scope::TasksRead], 2);
    if let UserCommand::CreateApiKey { digest, .. } = &mut other {
        *digest = "someone else".into();
    }
    given::<User>(&[
        registered_alice(),
        key_created(7, vec![Scope::TasksRead], 1),
    ])
    .when(other)
    .then_error(UserError::KeyIdTaken(Uuid::from_u128(7)));
}

#[test]
fn given_a_user_when_create_key_breaking_a_rule_then_refused_naming_it() {
    given::<User>(&[registered_alice()])
        .when(create_key(1, vec![Scope::Admin], 1))
        .then_error(UserError::AdminScopeForbidden);
    given::<User>(&[registered_alice()])
        .when(create_key(1, vec![], 1))
        .then_error(UserError::NoScopes);
    let mut expired = create_key(1, vec![Scope::TasksRead], 10);
    if let UserCommand::CreateApiKey { expires_at, .. } = &mut expired {
        *expires_at = Some(at(5));
    }
    given::<User>(&[registered_alice()])
        .when(expired)
        .then_error(UserError::ExpiryInPast);
    let mut unnamed = create_key(1, vec![Scope::TasksRead], 1);
    if let UserCommand::CreateApiKey { name, .. } = &mut unnamed {
        *name = "   ".into();
    }
    given::<User>(&[registered_alice()])
        .when(unnamed)
        .then_error(UserError::InvalidKeyName);
    let mut full = vec![registered_alice()];
    for id in 0..ACTIVE_KEYS_MAX as u128 {
        full.push(key_created(100 + id, vec![Scope::TasksRead], 1));
    }
    given::<User>(&full)
        .when(create_key(1, vec![Scope::TasksRead], 2))
        .then_error(UserError::TooManyKeys);
    // Expired keys no longer count.
    given::<User>(&full)
        .when(create_key(1, vec![Scope::TasksRead], 4000))
        .then(&[key_created(1, vec![Scope::TasksRead], 4000)]);
}

#[test]
fn given_a_key_when_revoked_then_revoked_once_and_no_longer_active() {
    let revoked = UserEvent::ApiKeyRevoked(ApiKeyRevoked {
        key_id: Uuid::from_u128(7),
        revoked_at: at(5),
    });
    given::<User>(&[
        registered_alice(),
        key_created(7, vec![Scope::TasksRead], 1),
    ])
    .when(UserCommand::RevokeApiKey {
        key_id: Uuid::from_u128(7),
        at: at(5),
    })
    .then(std::slice::from_ref(&revoked));
    given::<User>(&[
        registered_alice(),
        key_created(7, vec![Scope::TasksRead], 1),
        revoked.clone(),
    ])
    .when(UserCommand::RevokeApiKey {
        key_id: Uuid::from_u128(7),
        at: at(6),
    })
    .then(&[]);
    given::<User>(&[registered_alice()])
        .when(UserCommand::RevokeApiKey {
            key_id: Uuid::from_u128(7),
            at: at(6),
        })
        .then_error(UserError::KeyNotFound);
    let state = User::fold(&[
        registered_alice(),
        key_created(7, vec![Scope::TasksRead], 1),
        revoked,
    ]);
    let UserState::Registered(user) = state else {
        panic!("registered");
    };
    let key = user.api_key("digest-7").unwrap();
    assert!(!key.is_active(at(6)));
    assert_eq!(key.revoked_at, Some(at(5)));
}

#[test]
fn given_nothing_when_register_with_name_and_password_then_registered() {
    given::<User>(&[])
        .when(UserCommand::Register {
            user_id: alice(),
            username: Some(Username::parse("Alice").unwrap()),
            password_hash: Some(hash("one")),
            phone: None,
            role: Role::User,
            at: at(0),
        })
        .then(&[registered_alice()]);
}

#[test]
fn given_nothing_when_register_with_phone_only_then_registered() {
    let phone = PhoneNumber::parse("+8613800138000").unwrap();
    given::<User>(&[])
        .when(UserCommand::Register {
            user_id: alice(),
            username: None,
            password_hash: None,
            phone: Some(phone.clone()),
            role: Role::User,
            at: at(0),
        })
        .then(&[UserEvent::Registered(UserRegistered {
            user_id: alice(),
            username: None,
            password_hash: None,
            phone: Some(phone),
            role: Role::User,
            registered_at: at(0),
        })]);
}

#[test]
fn given_nothing_when_register_without_credentials_then_refused() {
    given::<User>(&[])
        .when(UserCommand::Register {
            user_id: alice(),
            username: None,
            password_hash: None,
            phone: None,
            role: Role::User,
            at: at(0),
        })
        .then_error(UserError::NoCredentials);
}

#[test]
fn given_nothing_when_register_name_without_password_then_refused() {
    given::<User>(&[])
        .when(UserCommand::Register {
            user_id: alice(),
            username: Some(Username::parse("alice").unwrap()),
            password_hash: None,
            phone: None,
            role: Role::User,
            at: at(0),
        })
        .then_error(UserError::UsernameWithoutPassword);
}

#[test]
fn given_registered_when_register_again_then_refused() {
    given::<User>(&[registered_alice()])
        .when(UserCommand::Register {
            user_id: alice(),
            username: Some(Username::parse("alice").unwrap()),
            password_hash: Some(hash("two")),
            phone: None,
            role: Role::User,
            at: at(1),
        })
        .then_error(UserError::AlreadyRegistered(alice()));
}

#[test]
fn given_nothing_when_change_role_then_not_registered() {
    given::<User>(&[])
        .when(UserCommand::ChangeRole {
            role: Role::Admin,
            at: at(1),
        })
        .then_error(UserError::NotRegistered);
}

#[test]
fn given_registered_when_change_role_then_changed_and_a_repeat_is_a_no_op() {
    given::<User>(&[registered_alice()])
        .when(UserCommand::ChangeRole {
            role: Role::Admin,
            at: at(1),
        })
        .then(&[UserEvent::RoleChanged(RoleChanged {
            role: Role::Admin,
            changed_at: at(1),
        })]);
    given::<User>(&[
        registered_alice(),
        UserEvent::RoleChanged(RoleChanged {
            role: Role::Admin,
            changed_at: at(1),
        }),
    ])
    .when(UserCommand::ChangeRole {
        role: Role::Admin,
        at: at(2),
    })
    .then(&[]);
}

#[test]
fn given_registered_when_change_password_then_changed() {
    given::<User>(&[registered_alice()])
        .when(UserCommand::ChangePassword {
            password_hash: hash("two"),
            at: at(1),
        })
        .then(&[UserEvent::PasswordChanged(PasswordChanged {
            password_hash: hash("two"),
            changed_at: at(1),
        })]);
}

#[test]
fn given_phone_bound_when_bind_another_then_refused_and_the_same_is_a_no_op() {
    let first = PhoneNumber::parse("+8613800138000").unwrap();
    let second = PhoneNumber::parse("+8613900139000").unwrap();
    let history = [
        registered_alice(),
        UserEvent::PhoneBound(PhoneBound {
            phone: first.clone(),
            bound_at: at(1),
        }),
    ];
    given::<User>(&history)
        .when(UserCommand::BindPhone {
            phone: second,
            at: at(2),
        })
        .then_error(UserError::PhoneAlreadyBound {
            bound: first.clone(),
        });
    given::<User>(&history)
        .when(UserCommand::BindPhone {
            phone: first,
            at: at(2),
        })
        .then(&[]);
}

#[test]
fn usernames_follow_the_rules_and_are_case_insensitive() {
    assert_eq!(Username::parse(" Alice ").unwrap().as_str(), "alice");
    assert!(Username::parse("al").is_err());
    assert!(Username::parse(&"a".repeat(33)).is_err());
    assert!(Username::parse("1alice").is_err());
    assert!(Username::parse("ali ce").is_err());
    assert!(Username::parse("alice\"}").is_err());
    assert!(Username::parse("a.l-i_c3").is_ok());
}

#[test]
fn phone_numbers_are_normalised_to_e164() {
    assert_eq!(
        PhoneNumber::parse("138 0013 8000").unwrap().as_str(),
        "+8613800138000"
    );
    assert_eq!(
        PhoneNumber::parse("+1 (415) 555-0100").unwrap().as_str(),
        "+14155550100"
    );
    assert!(PhoneNumber::parse("12345").is_err());
    assert!(PhoneNumber::parse("+12ab").is_err());
    assert!(PhoneNumber::parse("+0123456789").is_err());
    assert!(PhoneNumber::parse(&format!("+{}", "1".repeat(16))).is_err());
}

#[test]
fn a_password_hash_never_shows_in_debug_output() {
    let printed = format!("{:?}", registered_alice());
    assert!(!printed.contains("argon2id"), "{printed}");
}

#[test]
fn every_event_round_trips_through_its_stored_form() {
    let events = [
        registered_alice(),
        UserEvent::PasswordChanged(PasswordChanged {
            password_hash: hash("two"),
            changed_at: at(1),
        }),
        UserEvent::RoleChanged(RoleChanged {
            role: Role::Admin,
            changed_at: at(2),
        }),
        UserEvent::PhoneBound(PhoneBound {
            phone: PhoneNumber::parse("+8613800138000").unwrap(),
            bound_at: at(3),
        }),
        key_created(9, vec![Scope::TasksWrite, Scope::Admin], 4),
        UserEvent::ApiKeyRevoked(ApiKeyRevoked {
            key_id: Uuid::from_u128(9),
            revoked_at: at(5),
        }),
    ];
    for event in events {
        let stored = event.to_payload();
        let back =
            UserEvent::from_stored(event.event_type(), event.schema_version(), &stored).unwrap();
        assert_eq!(back, event);
    }
}

#[test]
fn a_stored_v1_payload_still_folds() {
    // Written by the first release; must keep loading as long as such events exist.
    let payload = serde_json::json!({
        "user_id": "00000000-0000-0000-0000-000000000001",
        "username": "alice",
        "password_hash": "$argon2id$v=19$m=19456,t=2,p=1$one",
        "phone": null,
        "role": "user",
        "registered_at": "2027-01-15T08:00:00Z"
    })
    .into();
    let event = UserEvent::from_stored("UserRegistered", 1, &payload).unwrap();
    let state = User::fold(&[event]);
    assert!(matches!(state, UserState::Registered(user) if user.role == Role::User));
    assert_eq!(
        UserEvent::from_stored("UserRegistered", 9, &payload),
        Err(DecodeError::UnknownVersion {
            event_type: "UserRegistered".into(),
            schema_version: 9
        })
    );
    assert!(matches!(
        UserEvent::from_stored("UserVanished", 1, &payload),
        Err(DecodeError::UnknownType { .. })
    ));
}

fn renamed(name: &str, at_seconds: i64) -> UserEvent {
    UserEvent::DisplayNameSet(DisplayNameSet {
        name: Some(DisplayName::parse(name).unwrap()),
        set_at: at(at_seconds),
    })
}

fn rename(name: &str, at_seconds: i64) -> UserCommand {
    UserCommand::SetDisplayName {
        name: Some(DisplayName::parse(name).unwrap()),
        at: at(at_seconds),
    }
}

#[test]
fn given_a_user_when_set_display_name_then_set_and_the_same_name_again_is_done_already() {
    given::<User>(&[registered_alice()])
        .when(rename("  西湖边的画室 ", 10))
        .then(&[renamed("西湖边的画室", 10)]);
    given::<User>(&[registered_alice(), renamed("西湖边的画室", 10)])
        .when(rename("西湖边的画室", 20))
        .then(&[]);
    given::<User>(&[registered_alice(), renamed("西湖边的画室", 10)])
        .when(UserCommand::SetDisplayName {
            name: None,
            at: at(20),
        })
        .then(&[UserEvent::DisplayNameSet(DisplayNameSet {
            name: None,
            set_at: at(20),
        })]);
    given::<User>(&[])
        .when(rename("无人", 1))
        .then_error(UserError::NotRegistered);
}

#[test]
fn given_five_renames_in_a_day_when_another_then_refused_until_the_oldest_is_a_day_old() {
    let day = RENAME_WINDOW_HOURS * 3600;
    let mut history = vec![registered_alice()];
    for index in 0..5 {
        history.push(renamed(&format!("画师{index}"), 100 + index * 60));
    }
    given::<User>(&history)
        .when(rename("第六个名字", 400))
        .then_error(UserError::RenamedTooOften {
            again_at: at(100 + day),
        });
    given::<User>(&history)
        .when(rename("第六个名字", 100 + day))
        .then(&[renamed("第六个名字", 100 + day)]);
    // The same name again is no change, so no limit refuses it.
    given::<User>(&history).when(rename("画师4", 400)).then(&[]);
}

#[test]
fn a_display_name_is_one_line_of_up_to_twenty_characters_in_any_language_without_a_hash() {
    assert_eq!(
        DisplayName::parse(" 山水之间 ").unwrap().as_str(),
        "山水之间"
    );
    let twenty = "画".repeat(DISPLAY_NAME_LENGTH_MAX);
    assert!(DisplayName::parse(&twenty).is_ok());
    let refused = |raw: &str| DisplayName::parse(raw).unwrap_err().0.rule;
    assert_eq!(
        refused(&format!("{twenty}画")),
        crate::rule::Rule::LengthAtMost
    );
    assert_eq!(refused("  "), crate::rule::Rule::NotEmpty);
    assert_eq!(refused("\u{200B}"), crate::rule::Rule::NotEmpty);
    assert_eq!(refused("第一行\n第二行"), crate::rule::Rule::OneLine);
    assert_eq!(refused("user#0123456789"), crate::rule::Rule::NotContain);
    assert_eq!(refused("画师#1"), crate::rule::Rule::NotContain);
}

fn registered_by_phone() -> UserEvent {
    UserEvent::Registered(UserRegistered {
        user_id: alice(),
        username: None,
        password_hash: None,
        phone: Some(PhoneNumber::parse("+8613800138000").unwrap()),
        role: Role::User,
        registered_at: at(0),
    })
}

fn set_username(name: &str, tag: &str, at_seconds: i64) -> UserCommand {
    UserCommand::SetUsername {
        username: Username::parse(name).unwrap(),
        password_hash: hash(tag),
        at: at(at_seconds),
    }
}

#[test]
fn given_a_phone_user_when_set_username_then_both_set_and_a_password_can_change_after() {
    let username_set = UserEvent::UsernameSet(UsernameSet {
        username: Username::parse("xiaoyu").unwrap(),
        password_hash: hash("one"),
        set_at: at(5),
    });
    given::<User>(&[registered_by_phone()])
        .when(set_username("xiaoyu", "one", 5))
        .then(std::slice::from_ref(&username_set));
    // A phone user has no password to change; once set, they do.
    given::<User>(&[registered_by_phone()])
        .when(UserCommand::ChangePassword {
            password_hash: hash("two"),
            at: at(6),
        })
        .then_error(UserError::PasswordWithoutUsername);
    given::<User>(&[registered_by_phone(), username_set.clone()])
        .when(UserCommand::ChangePassword {
            password_hash: hash("two"),
            at: at(6),
        })
        .then(&[UserEvent::PasswordChanged(PasswordChanged {
            password_hash: hash("two"),
            changed_at: at(6),
        })]);
    // Sent again (a retried request): done already, whatever its salt.
    given::<User>(&[registered_by_phone(), username_set])
        .when(set_username("xiaoyu", "three", 7))
        .then(&[]);
}

#[test]
fn given_a_username_when_set_another_then_refused() {
    given::<User>(&[registered_alice()])
        .when(set_username("alice2", "one", 5))
        .then_error(UserError::UsernameAlreadySet {
            username: Username::parse("alice").unwrap(),
        });
}
